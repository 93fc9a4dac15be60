"""Typed reads of an untrusted config.json: the one accessor every family's config parsing uses.

config.json comes from anyone (issue #25 §3): a field of the wrong type (``"abc"`` where a count
is expected, ``quantization_config`` as a string, ``weight_block_size: 128``), a bool where an
integer belongs (``True`` is an ``int`` in Python), a negative, zero or absurd value must be a
:class:`HetquantError` naming the file, the field, the value found and what is expected — never
a traceback, and never a value coerced silently (``int("3")``, ``bool("false")``).

``ConfigFields(raw, origin)`` wraps the dict; each reader takes the key, its default (``REQUIRED``:
the field must be there) and its range. A default applies when the field is absent or ``null``
(HF configs write ``null`` for "not set"). Sub-objects (``quantization_config``,
``rope_scaling``) are read through ``fields.mapping(key)``, whose messages name ``key.sub``.
Integers are capped at ``INT_MAX`` (2³¹ − 1): every dimension and count of a real model is far
below, and arithmetic on the config's values stays cheap and exact.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Final

from ..errors import HetquantError

__all__ = ["INT_MAX", "REQUIRED", "ConfigFields", "source_quantization"]

INT_MAX: Final = 2**31 - 1
REQUIRED: Final = object()  # the default of a field that must be present


def _show(value: Any) -> str:
    """``repr(value)``, cut to a readable length (a hostile field may be megabytes)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class ConfigFields:
    """Typed, range-checked reads of config.json ``raw`` (read from ``origin``)."""

    def __init__(self, raw: Mapping[str, Any], origin: str, prefix: str = "") -> None:
        self.raw, self.origin, self.prefix = raw, origin, prefix

    def fail(self, key: str, value: Any, expected: str) -> HetquantError:
        """The error for field ``key`` holding ``value`` where ``expected`` belongs."""
        return HetquantError(
            f"{self.origin}: field {self.prefix}{key} must be {expected}, got {_show(value)}; "
            "fix config.json (or re-download it from the checkpoint's repository)"
        )

    def require(self, keys: Iterable[str], hint: str) -> None:
        """Refuse a config that lacks any of ``keys``, naming every missing one and ``hint``."""
        missing = [k for k in keys if k not in self.raw]
        if missing:
            raise HetquantError(f"{self.origin}: missing field(s) {', '.join(missing)}; {hint}")

    def _get(self, key: str, default: Any) -> tuple[bool, Any]:
        """(set, value): ``set`` False when absent or null (then ``value`` is ``default``)."""
        value = self.raw.get(key)
        if value is not None:
            return True, value
        if default is REQUIRED:
            raise HetquantError(f"{self.origin}: field {self.prefix}{key} is missing (or null)")
        return False, default

    def integer(self, key: str, default: Any = REQUIRED, *, lo: int = 1, hi: int = INT_MAX) -> Any:
        """An integer in [lo, hi] (not a bool, not a float, not a numeric string)."""
        given, value = self._get(key, default)
        if given and (not _is_int(value) or not lo <= value <= hi):
            raise self.fail(key, value, f"an integer in [{lo}, {hi}]")
        return value

    def number(
        self, key: str, default: Any = REQUIRED, *, lo: float = 0.0, positive: bool = False
    ) -> Any:
        """A finite number >= lo (> lo with ``positive``), returned as a float."""
        given, value = self._get(key, default)
        if not given:
            return value
        ok = (_is_int(value) or isinstance(value, float)) and math.isfinite(value)
        if not ok or value < lo or (positive and value == lo):
            raise self.fail(key, value, f"a finite number {'>' if positive else '>='} {lo:g}")
        return float(value)

    def flag(self, key: str, default: Any = REQUIRED) -> Any:
        """A JSON boolean (``true`` / ``false``)."""
        given, value = self._get(key, default)
        if given and not isinstance(value, bool):
            raise self.fail(key, value, "true or false")
        return value

    def text(self, key: str, default: Any = REQUIRED, choices: tuple[str, ...] = ()) -> Any:
        """A string (one of ``choices`` when given)."""
        given, value = self._get(key, default)
        if given and (not isinstance(value, str) or (choices and value not in choices)):
            expected = "one of " + ", ".join(choices) if choices else "a string"
            raise self.fail(key, value, expected)
        return value

    def integers(
        self, key: str, default: Any = REQUIRED, *, lo: int = 0, length: int | None = None
    ) -> Any:
        """A list of integers in [lo, INT_MAX] (of ``length`` items when given), as a tuple."""
        given, value = self._get(key, default)
        if not given:
            return value
        ok = isinstance(value, list) and all(_is_int(x) and lo <= x <= INT_MAX for x in value)
        if not ok or (length is not None and len(value) != length):
            n = f"{length} " if length is not None else ""
            raise self.fail(key, value, f"a list of {n}integers >= {lo}")
        return tuple(value)

    def texts(self, key: str, default: Any = REQUIRED) -> Any:
        """A list of strings, as a tuple."""
        given, value = self._get(key, default)
        if given and (not isinstance(value, list) or not all(isinstance(x, str) for x in value)):
            raise self.fail(key, value, "a list of strings")
        return tuple(value) if given else value

    def mapping(self, key: str) -> ConfigFields:
        """Sub-object ``key`` (absent or null: an empty one) read the same way."""
        _, value = self._get(key, {})
        if not isinstance(value, Mapping):
            raise self.fail(key, value, "a JSON object")
        return ConfigFields(value, self.origin, f"{self.prefix}{key}.")


def source_quantization(f: ConfigFields) -> tuple[int, int] | None:
    """Validate ``quantization_config`` (an object; ``quant_method`` and ``scale_fmt`` strings)
    and return the FP8 source's ``weight_block_size`` (None: not FP8, or per-tensor FP8)."""
    qc = f.mapping("quantization_config")
    method = qc.text("quant_method", None)
    qc.text("scale_fmt", None)
    if method != "fp8":
        return None
    return qc.integers("weight_block_size", None, lo=1, length=2)
