"""Which stored tensors of a source make up each role's tensor, and in which format.

The source's tensors are grouped by module prefix. A role whose tensor is a 2-D ``weight`` takes
the module's tensors that no other role names and asks ``formats.identify`` what they are: FP8
blocks, BF16, compressed-tensors pack-quantized, … — the variant must be the one config.json
fixes (``PREFERRED``: the FP8 block edge) and the weight shape the one the config implies. What no
format claims is plain: one tensor of a float dtype, used as stored. Tensors no role takes are
refused, as are modules that carry a quantized format's signature but fit none.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from hetquant.formats import HetquantError, TensorMeta, WeightFormat, get_format
from hetquant.formats.ct_pack_quantized import CtPackQuantized
from hetquant.formats.ct_scheme import CT_METHOD, CtQuantConfig
from hetquant.formats.families import ModelConfig, TensorRole, expected_tensors
from hetquant.formats.fused_experts import unfuse
from hetquant.formats.identify import Identified, identify, missing_partners, show_meta
from hetquant.formats.safetensors_io import HeaderEntry

__all__ = ["PLAIN", "PREFERRED", "attach_roles"]

PLAIN = "plain"  # the format name of a tensor no weight format claims
PLAIN_DTYPES = frozenset({"BF16", "F16", "F32", "F64"})
INDEX_DTYPES = frozenset({"I32", "I64"})  # an ``index`` role's table (DeepSeek-V4's tid2eid)
Entries = dict[str, tuple[str, HeaderEntry]]  # tensor name → (shard file, header entry)
Attached = tuple[TensorRole, Entries, WeightFormat | None]  # role, parts by key, format

PREFERRED: tuple[Callable[[ModelConfig], WeightFormat], ...] = (
    lambda c: get_format(
        "fp8_block",
        block=c.weight_block_size[0] if c.weight_block_size else 128,
        scale_fmt=c.quantization_config.get("scale_fmt") or "float",
    ),
)
"""Format variants whose parameters config.json fixes (shapes alone may leave them open)."""


def attach_roles(cfg: ModelConfig, entries: Entries) -> dict[str, Attached]:
    """Role tensor name → (role, its stored tensors by local key, format or None); fused 3-D
    experts are read as the per-expert tensors they hold (``formats/fused_experts.py``)."""
    entries = unfuse(cfg, entries)
    expected = expected_tensors(cfg)
    _refuse_by_name(cfg, entries, expected)
    modules: dict[str, Entries] = {}
    for name, fe in entries.items():
        prefix, _, key = name.rpartition(".")
        modules.setdefault(prefix, {})[key] = fe
    preferred = {f.name: f for f in (make(cfg) for make in PREFERRED)}
    schemes = _source_schemes(cfg)
    seen: dict[frozenset[tuple[str, TensorMeta]], Identified | None] = {}  # _module's memo
    out: dict[str, Attached] = {}
    for name, role in expected.items():
        prefix, _, key = name.rpartition(".")
        if key == "weight" and len(role.shape) == 2:
            members = {
                k: fe for k, fe in modules.get(prefix, {}).items()
                if k == key or f"{prefix}.{k}" not in expected
            }  # fmt: skip
            if schemes is not None:
                schemes.check(prefix, role.role.kind, role.shape, members)
            out[name] = _module(name, role, members, preferred, seen)
            _check_group(out[name], prefix, schemes)
        else:
            out[name] = (role, {key: _plain(name, role, entries)}, None)
    claimed = {_join(t.rpartition(".")[0], k) for t, (_, parts, _) in out.items() for k in parts}
    unknown = [n for n in entries if n not in claimed]
    if unknown:
        raise HetquantError(
            f"tensor {unknown[0]!r} (and {len(unknown) - 1} more) matches no {cfg.family.name} role "
            "for this config; is config.json from the same checkpoint?"
        )
    return out


def _join(prefix: str, key: str) -> str:
    """A stored name from its module prefix and key (a dot-less global name has no prefix)."""
    return f"{prefix}.{key}" if prefix else key


def _source_schemes(cfg: ModelConfig) -> CtQuantConfig | None:
    """The source's compressed-tensors schemes (None: config.json declares none)."""
    qc = cfg.quantization_config
    return CtQuantConfig.parse(qc) if qc.get("quant_method") == CT_METHOD else None


def _check_group(attached: Attached, prefix: str, schemes: CtQuantConfig | None) -> None:
    """A compressed-tensors module's stored group is the one its config scheme declares."""
    role, _, fmt = attached
    if schemes is None or not isinstance(fmt, CtPackQuantized):
        return
    group = fmt.group_size
    scheme = schemes.scheme_for(prefix, role.role.kind, stored_quantized=True)
    if scheme is None or scheme.group_size != group:
        said = "no scheme" if scheme is None else f"group_size {scheme.group_size}"
        raise HetquantError(
            f"{prefix}: stored pack-quantized with group {group}, but config.json's "
            f"quantization_config gives it {said}; the checkpoint and its config disagree"
        )


def _refuse_by_name(cfg: ModelConfig, entries: Entries, expected: Mapping[str, Any]) -> None:
    """Tensors the family refuses by name (a layout it does not read); then every expected
    weight with no stored tensor at all, named together."""
    for name in entries:
        if name not in expected and (why := cfg.family.refusal(name)) is not None:
            raise HetquantError(f"tensor {name!r}: {why}")
    prefixes = {n.rpartition(".")[0] for n in entries}
    absent = [n for n in expected if n not in entries and n.rpartition(".")[0] not in prefixes]
    if len(absent) > 1:
        more = f" (and {len(absent) - 3} more)" if len(absent) > 3 else ""
        raise HetquantError(
            f"checkpoint lacks tensors {', '.join(map(repr, absent[:3]))}{more}, which "
            "config.json implies; incomplete?"
        )


def _module(
    name: str,
    role: TensorRole,
    members: Entries,
    preferred: Mapping[str, WeightFormat],
    seen: dict[frozenset[tuple[str, TensorMeta]], Identified | None],
) -> Attached:
    """``name``'s module read as its format. ``seen`` memoizes ``identify`` by the module's
    stored keys, dtypes and shapes — all it reads but the name its errors carry (a refusal is
    never memoized, so every message names its own module): DeepSeek-R1's 45,872 modules have
    a handful of signatures, and identifying each anew was a third of its plan's time."""
    prefix = name.rpartition(".")[0]
    metas = {k: e.meta for k, (_, e) in members.items()}
    signature = frozenset(metas.items())
    if signature in seen:
        got = seen[signature]
    else:
        got = identify(metas, name=prefix, prefer=preferred.values()) if metas else None
        seen[signature] = got
    if got is None:
        weight = {name: members["weight"]} if "weight" in members else {}
        return role, {"weight": _plain(name, role, weight)}, None
    want = preferred.get(got.fmt.name, got.fmt)
    if got.fmt != want or got.shape != role.shape:
        raise HetquantError(_mismatch(prefix, metas, want, role.shape))
    return role, {k: members[k] for k in got.keys}, got.fmt


def _plain(name: str, role: TensorRole, entries: Entries) -> tuple[str, HeaderEntry]:
    if name not in entries:
        raise HetquantError(
            f"checkpoint lacks tensor {name!r}, which config.json implies; incomplete?"
        )
    file, entry = entries[name]
    if entry.shape != role.shape:
        raise HetquantError(
            f"{name}: shape {list(entry.shape)} disagrees with config.json, which implies "
            f"{list(role.shape)}"
        )
    if entry.dtype not in PLAIN_DTYPES | (INDEX_DTYPES if role.role.kind == "index" else set()):
        key = name.rpartition(".")[2]
        need = missing_partners({key: entry.meta}, role.shape) if len(role.shape) == 2 else []
        raise HetquantError(
            f"{name}: a {entry.dtype} tensor without the tensors its format needs"
            + (f" ({'; '.join(need)})" if need else "")
            + "; the index or shards are incomplete"
        )
    return file, entry


def _mismatch(
    prefix: str, metas: Mapping[str, TensorMeta], want: WeightFormat, shape: tuple[int, ...]
) -> str:
    """Which stored tensor differs from what ``want`` stores for the config's ``shape``."""
    try:
        expect = want.stored(shape)  # type: ignore[arg-type]
    except HetquantError as e:
        return f"{prefix}: {e}"
    diff = [
        f"{prefix}.{k} is {show_meta(metas.get(k))}, expected {show_meta(m)}"
        for k, m in expect.items()
        if metas.get(k) != m
    ]
    return (
        f"{'; '.join(diff)} ({want.name} of a {list(shape)} weight, as config.json implies); "
        "the checkpoint is corrupt or not in the format its config declares"
    )
