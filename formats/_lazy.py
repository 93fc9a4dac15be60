"""``torch``, imported where it is first used rather than where it is named.

``import torch`` costs 1.5-4.5 s (more than a whole small conversion), and a conversion whose every
job has a native kernel never needs it (``convert/engine/native_jobs.py``). The modules of
:mod:`hetquant.formats` and the conversion's path in :mod:`hetquant.convert` therefore write
``from hetquant.formats._lazy import torch``: an attribute of this stand-in (``torch.float32``,
``torch.empty``, ``torch.nn.functional``) imports torch on first use and is then looked up in it,
so code reads as it would with the module itself, and whatever runs without touching torch never
imports it. The stand-in is not put in ``sys.modules``: other libraries' "is torch loaded" checks
stay true to fact. Type annotations stay strings (``from __future__ import annotations``).

``tests/convert/engine/test_native_lane.py`` checks that the native conversions import no torch.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

__all__ = ["LazyModule", "torch"]


class LazyModule:
    """A module named ``name``, imported on the first attribute access."""

    def __init__(self, name: str) -> None:
        self.__dict__["_name"] = name

    def __getattr__(self, attr: str) -> Any:
        name = self.__dict__["_name"]
        module = sys.modules.get(name) or importlib.import_module(name)
        return getattr(module, attr)

    def __setattr__(self, attr: str, value: Any) -> None:
        raise AttributeError(f"set {attr} on the module {self._name} itself, not on its stand-in")

    def __repr__(self) -> str:
        return f"<lazily imported module {self._name!r}>"


torch: Any = LazyModule("torch")
