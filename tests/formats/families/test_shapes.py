"""Role shapes as data (``formats/families/shapes.py``): evaluation, printing, pickling, and every
registered family's table holding data only."""

from __future__ import annotations

import pickle
from dataclasses import dataclass

import pytest

from hetquant.formats.families import FAMILIES
from hetquant.formats.families.shapes import Call, Const, F, Field, K, Shape, shape


@dataclass(frozen=True)
class _Cfg:
    hidden_size: int = 64
    heads: int = 4
    head_dim: int = 16
    rank: int | None = None
    vision: dict | None = None

    @property
    def qk(self) -> int:  # a derived dimension: a property of the config
        return self.head_dim + 2

    def rate(self, scope: str) -> int:
        return {"csa": 4, "hca": 128}[scope]


def test_fields_constants_and_operators() -> None:
    cfg = _Cfg()
    s = shape(F.heads * F.qk, 2 * F.hidden_size + 1, F.heads * F.head_dim // 8, 3)
    assert s(cfg) == (4 * 18, 129, 8, 3)
    assert shape(Call("rate", "hca"), F.hidden_size)(cfg) == (128, 64)


def test_or_zero_reads_none_as_zero_only_when_asked() -> None:
    assert shape(F.rank.or_zero, F.hidden_size)(_Cfg()) == (0, 64)
    assert shape(F.rank.or_zero)(_Cfg(rank=8)) == (8,)
    assert shape(F.rank)(_Cfg()) == (None,)  # no default: None passes through


def test_of_reads_a_sub_config_by_key() -> None:
    s = Shape((K("hidden_size") * K("merge"), Const(3)), of="vision")
    assert s(_Cfg(vision={"hidden_size": 32, "merge": 4})) == (128, 3)


def test_equal_expressions_are_equal_and_hash_alike() -> None:
    a, b = shape(F.heads * F.head_dim, F.hidden_size), shape(F.heads * F.head_dim, F.hidden_size)
    assert a == b and hash(a) == hash(b)
    assert a != shape(F.head_dim * F.heads, F.hidden_size)  # as written, not as computed


def test_str_shows_the_expression() -> None:
    assert str(shape(F.heads * F.qk, F.rank.or_zero, 3)) == "[(heads * qk), (rank or 0), 3]"
    assert str(Shape((K("h"),), of="vision")) == "vision[[h]]"


def test_a_dim_is_a_dim_or_an_int() -> None:
    with pytest.raises(TypeError, match="a Dim or an int"):
        shape(F.heads, 1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="a Dim or an int"):
        shape(True)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        F.heads * "2"  # type: ignore[operator]


def test_pickles_to_an_equal_expression() -> None:
    s = shape(F.heads * F.qk // 2, Call("rate", "csa") + 1, Field("rank", 0))
    back = pickle.loads(pickle.dumps(s))
    assert back == s and back(_Cfg()) == s(_Cfg())


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_table_is_data(name: str) -> None:
    """Every role of every registered family carries a Shape, and the table pickles whole."""
    roles = FAMILIES[name].roles
    assert all(isinstance(r.shape, Shape) for r in roles)
    assert pickle.loads(pickle.dumps(roles)) == roles


def test_a_family_with_a_function_for_a_shape_is_refused() -> None:
    """A lambda would make every plan holding the role unpicklable: refused at registration."""
    import dataclasses

    from hetquant.formats.families import register_family

    base = FAMILIES["qwen3_moe"]
    bad = dataclasses.replace(base.roles[0], shape=lambda c: (c.vocab_size, c.hidden_size))
    cfg_type = type("LambdaConfig", (base.config_type,), {})
    family = dataclasses.replace(
        base, name="lambda_toy", config_type=cfg_type, roles=(bad, *base.roles[1:])
    )
    with pytest.raises(RuntimeError, match=r"role embed: shape is not a shapes\.Shape"):
        register_family(family)
    assert "lambda_toy" not in FAMILIES
