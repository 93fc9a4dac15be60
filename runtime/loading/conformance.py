"""Every stored tensor agrees with config.json before anything runs (DESIGN.md: "every stored
shape agrees with the config before a forward").

The model a forward builds comes from config.json; the bytes it multiplies come from the shards.
If the two disagree — a norm of another width, a CPU expert layer with 4 experts where the
config has 8, a config edited to 2 layers or a smaller vocabulary — the forward either fails
deep inside torch or, worse, runs a different model and exits 0. So ``open_artifact`` compares
the two first, from headers only: the family's role table expanded for the config
(``expected_tensors``: every tensor's name and logical shape, the table convert's plan lays out)
against what the artifact stores —

- root part: each module's logical weight shape (its format's ``[out, in]``, already checked
  against its stored tensors) or a plain tensor's own shape;
- ``cpu_experts/``: each MoE layer's experts ``E`` of ``[I, H]`` gate and up and ``[H, I]``
  down (the plan's stacking of the same roles) —

and refuses a tensor whose shape differs, one the config implies that is stored nowhere, and one
stored that the config does not imply. The first is named in one line with the stored and the
expected shape; the others are counted.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from hetquant.formats.errors import HetquantError
from hetquant.formats.families import (
    ModelConfig,
    ModelFamily,
    TensorRole,
    expected_count,
    expected_tensors,
)

from ..parallel.pieces import ModuleInfo

if TYPE_CHECKING:
    from ..experts._expert_files import ExpertLayerInfo

__all__ = ["check_conforms", "check_pool_layers", "stored_shapes"]

_FIX = "the artifact does not match its config.json; re-download it or re-run the conversion"


def stored_shapes(
    root: Path,
    modules: Mapping[str, ModuleInfo],
    layers: Mapping[int, ExpertLayerInfo],
    family: ModelFamily,
) -> dict[str, tuple[tuple[int, ...], Path]]:
    """Logical tensor name → (shape, file holding it) of everything the artifact stores."""
    out = dict(_root_shapes(root, modules))
    for name, (shape, file) in _pool_shapes(layers, family):
        if name in out:
            raise HetquantError(
                f"{file}: {name} is stored twice, here and in {out[name][1]}; {_FIX}"
            )
        out[name] = (shape, file)
    return out


def check_conforms(
    root: Path,
    cfg: ModelConfig,
    modules: Mapping[str, ModuleInfo],
    layers: Mapping[int, ExpertLayerInfo],
) -> None:
    """Refuse (HetquantError, one line) an artifact whose stored tensors are not exactly the
    ones config.json implies, with their shapes (module docstring)."""
    stored = stored_shapes(root, modules, layers, cfg.family)
    _refuse_differences(root, _expected(root, cfg, len(stored)), stored)


def _expected(root: Path, cfg: ModelConfig, stored: int) -> dict[str, TensorRole]:
    """``expected_tensors(cfg)``, unless config.json claims so many more tensors than the
    artifact stores that expanding them would only cost memory and time (an edited config
    claiming 10⁶ experts): counted first, per layer (``expected_count``), and refused then."""
    if (count := expected_count(cfg)) > 2 * stored + _SLACK:
        raise HetquantError(
            f"{root}: config.json implies {count:,} tensors, the artifact stores {stored:,}; {_FIX}"
        )
    return expected_tensors(cfg)


_SLACK = 1024  # names a config may claim beyond twice what is stored before it is not expanded


def check_pool_layers(root: Path, cfg: ModelConfig, layers: Mapping[int, ExpertLayerInfo]) -> None:
    """``check_conforms`` for the CPU expert pool opened alone: the routed experts of ``layers``."""
    stored = dict(_pool_shapes(layers, cfg.family))
    every = _expected(root, cfg, len(stored) + len(cfg.family.roles) * cfg.total_layers)
    expected = {n: t for n, t in every.items() if t.layer in layers and t.stack}
    _refuse_differences(root, expected, stored)


def _refuse_differences(
    root: Path,
    expected: Mapping[str, TensorRole],
    stored: Mapping[str, tuple[tuple[int, ...], Path]],
) -> None:
    wrong = [n for n, (shape, _) in stored.items() if n in expected and shape != expected[n].shape]
    missing = [n for n in expected if n not in stored]
    extra = [n for n in stored if n not in expected]
    if wrong:
        name, (shape, file) = wrong[0], stored[wrong[0]]
        want = list(expected[name].shape)
        raise HetquantError(
            f"{file}: {name} has shape {list(shape)} but config.json implies {want}"
            f"{_more(wrong)}; {_FIX}"
        )
    if missing:
        name = missing[0]
        raise HetquantError(
            f"{root}: config.json implies {name} {list(expected[name].shape)}, which no file of "
            f"the artifact stores{_more(missing)}; {_FIX}"
        )
    if extra:
        name, (shape, file) = extra[0], stored[extra[0]]
        raise HetquantError(
            f"{file}: stores {name} {list(shape)}, which config.json does not imply"
            f"{_more(extra)}; {_FIX}"
        )


def _more(names: list[str]) -> str:
    return f" (and {len(names) - 1} more tensors like it)" if len(names) > 1 else ""


def _root_shapes(
    root: Path, modules: Mapping[str, ModuleInfo]
) -> Iterator[tuple[str, tuple[tuple[int, ...], Path]]]:
    for info in modules.values():
        if info.fmt is not None:  # a linear in a weight format: its [out, in]
            file = next(iter(info.entries.values()))[0]
            yield f"{info.prefix}.weight", (tuple(info.shape), root / file)
            continue
        for key, (file, entry) in info.entries.items():
            name = f"{info.prefix}.{key}" if info.prefix else key  # a dot-less global name
            yield name, (tuple(entry.shape), root / file)


def _pool_shapes(
    layers: Mapping[int, ExpertLayerInfo], family: ModelFamily
) -> Iterator[tuple[str, tuple[tuple[int, ...], Path]]]:
    mlp = family.mlp("routed")
    if mlp is None:
        return
    for layer, info in layers.items():
        gate_up, down = (info.inter, info.hidden), (info.hidden, info.inter)
        for e in range(info.num_experts):
            for role, shape in ((mlp.gate, gate_up), (mlp.up, gate_up), (mlp.down, down)):
                yield family.tensor(role, layer, e), (shape, info.path)
