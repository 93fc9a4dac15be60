"""A role's expected shape as data: config fields combined by ``+``, ``*`` and ``//``.

A role table row says what shape its tensor has for a config (``Role.shape``). Written as an
expression over named config fields — ``shape(F.vocab_size, F.hidden_size)``,
``shape(F.num_attention_heads * F.qk_head_dim, F.q_lora_rank.or_zero)`` — instead of a function,
it is plain frozen data: a plan that carries roles can be pickled to a worker process, compared
and printed. Evaluating it reads the named attributes of the config (properties included), so a
family keeps its derived dimensions (``qk_head_dim``) on its config type.

- ``F.name`` (:class:`Field`): ``cfg.name``; ``.or_zero`` reads None as 0 (an optional rank);
- ``K("name")`` (:class:`Key`): ``cfg["name"]`` (a VLM's vision config is a mapping);
- ``Call("rate", "csa")``: ``cfg.rate("csa")`` (a value the config keys by scope);
- ints are constants; ``a + b``, ``a * b``, ``a // b`` combine any two of them.

``Shape(dims, of="vision")`` evaluates its dims on ``cfg.vision`` (the vision tower's config).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Call", "Const", "Dim", "F", "Field", "K", "Key", "Shape", "shape"]


class Dim:
    """An integer of a config (module docstring); subclasses are frozen dataclasses."""

    def __call__(self, cfg: Any) -> int:
        raise NotImplementedError

    def __add__(self, other: Dim | int) -> Dim:
        return _Op("+", self, _dim(other))

    def __radd__(self, other: int) -> Dim:
        return _Op("+", _dim(other), self)

    def __mul__(self, other: Dim | int) -> Dim:
        return _Op("*", self, _dim(other))

    def __rmul__(self, other: int) -> Dim:
        return _Op("*", _dim(other), self)

    def __floordiv__(self, other: Dim | int) -> Dim:
        return _Op("//", self, _dim(other))


@dataclass(frozen=True)
class Const(Dim):
    """A number the format of the tensor fixes (a hyper-connection's 3 scales)."""

    value: int

    def __call__(self, cfg: Any) -> int:
        return self.value

    def __str__(self) -> str:
        return str(self.value)


@dataclass(frozen=True)
class Field(Dim):
    """``cfg.<name>``; with ``none_as`` set, a None value reads as it."""

    name: str
    none_as: int | None = None

    @property
    def or_zero(self) -> Field:
        """This field, None read as 0 (``q_lora_rank`` of a model without a q LoRA)."""
        return Field(self.name, 0)

    def __call__(self, cfg: Any) -> int:
        value = getattr(cfg, self.name)
        return self.none_as if value is None and self.none_as is not None else value

    def __str__(self) -> str:
        return self.name if self.none_as is None else f"({self.name} or {self.none_as})"


@dataclass(frozen=True)
class Key(Dim):
    """``cfg[<name>]``: a field of a mapping-like config (``vlm.VisionConfig``)."""

    name: str

    def __call__(self, cfg: Any) -> int:
        return cfg[self.name]

    def __str__(self) -> str:
        return f"[{self.name}]"


K = Key


@dataclass(frozen=True)
class Call(Dim):
    """``cfg.<method>(<arg>)``: a value the config keys by a name (DeepSeek-V4's ``rate``)."""

    method: str
    arg: str

    def __call__(self, cfg: Any) -> int:
        return getattr(cfg, self.method)(self.arg)

    def __str__(self) -> str:
        return f"{self.method}({self.arg})"


_OPS = {"+": int.__add__, "*": int.__mul__, "//": int.__floordiv__}


@dataclass(frozen=True)
class _Op(Dim):
    """``left <op> right``."""

    op: str
    left: Dim
    right: Dim

    def __call__(self, cfg: Any) -> int:
        return _OPS[self.op](int(self.left(cfg)), int(self.right(cfg)))

    def __str__(self) -> str:
        return f"({self.left} {self.op} {self.right})"


def _dim(x: Dim | int) -> Dim:
    if isinstance(x, Dim):
        return x
    if isinstance(x, int) and not isinstance(x, bool):
        return Const(x)
    raise TypeError(f"a shape dim is a Dim or an int, not {type(x).__name__}")


class _Fields:
    """``F.hidden_size`` is ``Field("hidden_size")``."""

    def __getattr__(self, name: str) -> Field:
        if name.startswith("__"):
            raise AttributeError(name)
        return Field(name)


F = _Fields()


@dataclass(frozen=True)
class Shape:
    """A tensor's shape for a config: one :class:`Dim` per axis, read on ``cfg`` (or on
    ``getattr(cfg, of)``)."""

    dims: tuple[Dim, ...]
    of: str | None = None

    def __call__(self, cfg: Any) -> tuple[int, ...]:
        on = cfg if self.of is None else getattr(cfg, self.of)
        return tuple(d(on) for d in self.dims)

    def __str__(self) -> str:
        inner = ", ".join(map(str, self.dims))
        return f"[{inner}]" if self.of is None else f"{self.of}[{inner}]"


def shape(*dims: Dim | int) -> Shape:
    """``Shape`` of ``dims`` (ints become constants)."""
    return Shape(tuple(_dim(d) for d in dims))
