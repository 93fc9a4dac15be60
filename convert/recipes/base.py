"""The recipe contract: :class:`Recipe`, :class:`Target`, the registry keyed by name.

A recipe looks at one source tensor (its role in the model family's table and its source format:
a registered format's name, or ``plain``) and returns a :class:`Target`: which part of the artifact
it goes to and in which format. ``copy`` keeps the source bytes as they are; :func:`keep` is
"at source precision". Recipes are data; the engine never branches on their names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hetquant.formats import FORMATS, ExpertLayerFormat, HetquantError, WeightFormat
from hetquant.formats.families import TensorRole

__all__ = [
    "AS_STORED",
    "COPY",
    "COPY_TARGET",
    "DROP",
    "DROP_TARGET",
    "RECIPES",
    "ROOT",
    "Action",
    "Recipe",
    "Target",
    "Written",
    "get_recipe",
    "keep",
    "register_recipe",
]

COPY = "copy"  # the source bytes as they are
DROP = "drop"  # left out of the artifact (e.g. the MTP layer with --mtp drop)
ROOT = "root"
AS_STORED = frozenset({"plain", "bf16"})  # source formats kept byte for byte at source precision
Written = WeightFormat | ExpertLayerFormat  # what a CONVERT target writes
_UNSET = object()


class Action(Enum):
    """What becomes of a source tensor: its bytes as they are, nothing, or written in a format
    (quantized, dequantized or repacked: ``Target.fmt`` says how)."""

    COPY = COPY
    DROP = DROP
    CONVERT = "convert"


@dataclass(frozen=True)
class Target:
    """Where one source tensor goes and what it becomes.

    ``action``; for ``CONVERT`` the format object written (``fmt``: the variant, ``params``
    applied) — a per-linear format, or an expert-layer one (all routed experts of a layer
    stacked). ``params``: the parameters the recipe set, as the plan digest records them.
    ``name`` is what manifests record: the format's name, or the action's (``copy``, ``drop``).
    """

    action: Action
    fmt: Written | None = None
    params: tuple[tuple[str, Any], ...] = ()
    part: str = ROOT
    file: str | None = None  # parts other than the root name their file (e.g. one per layer)
    container: str = "safetensors"  # the file's layout (``planning/containers.py``)

    def __post_init__(self) -> None:
        if (self.fmt is None) != (self.action is not Action.CONVERT):
            raise HetquantError(f"a {self.action.value} target takes a format only to convert")
        unset = [k for k, v in self.params if getattr(self.fmt, k, _UNSET) != v]
        if unset:
            raise HetquantError(f"target {self.name}: params {unset} are not applied to its format")

    @classmethod
    def writing(
        cls, fmt: Written, params: tuple[tuple[str, Any], ...] = (), **where: Any
    ) -> Target:
        """Convert into ``fmt`` (a format object) with ``params`` applied; ``where``: the
        part, file and container."""
        variant = dataclasses.replace(fmt, **dict(params)) if params else fmt
        return cls(Action.CONVERT, variant, tuple(params), **where)

    def with_params(self, params: tuple[tuple[str, Any], ...]) -> Target:
        """This target with ``params`` (a superset of its own) recorded and applied."""
        assert self.fmt is not None and dict(self.params).keys() <= dict(params).keys()
        return dataclasses.replace(
            self, fmt=dataclasses.replace(self.fmt, **dict(params)), params=params
        )

    @property
    def name(self) -> str:
        return self.action.value if self.fmt is None else self.fmt.name

    @property
    def stacks_experts(self) -> bool:
        """Writes an expert-layer format: the routed experts of a layer stacked."""
        return isinstance(self.fmt, ExpertLayerFormat)


COPY_TARGET, DROP_TARGET = Target(Action.COPY), Target(Action.DROP)


@dataclass(frozen=True)
class Recipe:
    """A named conversion: ``assign`` maps (role, source dtype) to a Target."""

    name: str
    summary: str
    options: dict[str, Any] = field(default_factory=dict)
    # option → allowed values, the default first
    choices: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    calibrates: bool = False  # takes --calib-data (AWQ); the manifest then says how
    # without --calib-data the manifest says {"method": "rtn"} (awq-w4a16's contract); False:
    # it has no calibration entry, as the recipe's artifacts had before it calibrated
    records_rtn: bool = True
    # what the Hub's model card says (``hub/model_card.py``): tags beside the model's and
    # hetquant's, the library the Hub shows, how engines serve the root (``serving.py``: lines,
    # ``{repo}`` the repository id; empty: only hetquant's loader is named)
    tags: tuple[str, ...] = ()
    library: str = "vllm"  # read by serving engines; "transformers" for a plain checkpoint
    serving: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for key, value in self.options.items():
            allowed = self.choices.get(key)
            if allowed is None:
                takes = ", ".join(self.choices) or "none"
                raise HetquantError(f"recipe {self.name} has no option {key!r}; it takes: {takes}")
            if value not in allowed:
                shown = ", ".join("unset" if v is None else repr(v) for v in allowed)
                raise HetquantError(f"recipe {self.name}: {key}={value!r} is not one of {shown}")

    def option(self, key: str) -> Any:
        """The value of option ``key``: given, or the default (first choice)."""
        return self.options.get(key, self.choices[key][0])

    def assign(self, role: TensorRole, source_fmt: str) -> Target:
        raise NotImplementedError

    def calibration(self, role: TensorRole) -> str | None:
        """What ``--calib-data`` does to a tensor of ``role``: ``"search"`` (a quantized linear
        whose AWQ scale and clip are searched), ``"quantized"`` (quantized, its quantizer in the
        objectives, not searched), None (not quantized). Here: None (no calibration)."""
        return None

    def refine(
        self, target: Target, source_params: tuple[tuple[str, Any], ...], source_fmt: str = ""
    ) -> Target:
        """``target`` given the source variant's format and parameters (``SourceItem.fmt``,
        ``.params``); as is here."""
        return target

    def check_model(self, roles: list[TensorRole]) -> None:
        """Refuse (HetquantError) an option the model gives nothing to act on, ``roles`` being
        every source tensor's; here nothing is refused."""

    def with_options(self, options: dict[str, Any]) -> Recipe:
        """This recipe with ``options`` (e.g. ``{"group_size": 64}``) replacing its defaults."""
        return dataclasses.replace(self, options={**self.options, **options})

    def quantization_config(self) -> dict[str, Any] | None:
        """The ``quantization_config`` of the root part's config.json (None: unquantized)."""
        return None


def keep(source_fmt: str) -> Target:
    """At source precision: plain tensors and BF16 weights as they are, a weight in any other
    source format (FP8 blocks, compressed-tensors INT4, ...) dequantized exactly to BF16."""
    return COPY_TARGET if source_fmt in AS_STORED else Target.writing(FORMATS["bf16"])


RECIPES: dict[str, Recipe] = {}


def register_recipe(recipe: Recipe) -> Recipe:
    if recipe.name in RECIPES:
        raise RuntimeError(f"recipe {recipe.name!r} registered twice")
    RECIPES[recipe.name] = recipe
    return recipe


def get_recipe(name: str) -> Recipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise HetquantError(
            f"unknown recipe {name!r}; `hetquant recipes` lists them: {', '.join(sorted(RECIPES))}"
        ) from None
