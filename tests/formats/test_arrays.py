"""formats/arrays.py: a kernel wrapper's result or ``NotNative``, its message built only then."""

from __future__ import annotations

import numpy as np
import pytest

from hetquant.formats.arrays import NotNative, native


def test_native_passes_a_result_through_without_building_its_message() -> None:
    def never() -> str:
        raise AssertionError("the message was built for a result")

    result = np.zeros(3)
    assert native(result, never) is result
    assert native(0, "a plain message") == 0  # a falsy result is still a result


@pytest.mark.parametrize("what", ["w8a8_dynamic: rows uint16", lambda: f"w8a8_dynamic: rows {np.dtype(np.uint16)}"])  # fmt: skip
def test_a_declined_kernel_raises_not_native_with_the_message(what) -> None:
    with pytest.raises(NotNative, match=r"^w8a8_dynamic: rows uint16$"):
        native(None, what)
