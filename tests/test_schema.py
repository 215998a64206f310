"""The typed schema: unknown keys, wrong types and missing keys are rejected with the path and what is valid."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest

from trnrecipes.schema import SchemaError, from_dict, to_dict


@dataclass(frozen=True)
class Inner:
    size: int
    mode: Literal["a", "b"] = "a"


@dataclass(frozen=True)
class Outer:
    inner: Inner
    rate: float = 1.0
    flag: bool = False
    name: str | None = None
    pair: tuple[float, float] = (0.1, 0.2)
    tags: list[str] = field(default_factory=list)


def test_valid_document_converts_and_round_trips():
    doc = {"inner": {"size": 3, "mode": "b"}, "rate": "1e-5", "flag": True, "pair": [1, 2], "tags": ["x"]}
    obj = from_dict(Outer, doc)
    assert obj == Outer(Inner(3, "b"), 1e-5, True, None, (1.0, 2.0), ["x"])
    assert to_dict(obj) == {
        "inner": {"size": 3, "mode": "b"}, "rate": 1e-5, "flag": True, "name": None, "pair": [1.0, 2.0], "tags": ["x"]
    }  # fmt: skip


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"inner": {"size": 1}, "rat": 2}, "rat: unknown key; valid keys here: inner, rate, flag, name, pair, tags"),
        ({"inner": {"size": 1, "colour": 2}}, "inner.colour: unknown key"),
        ({}, "inner: required key is missing"),
        ({"inner": {"size": "4"}}, "inner.size: expected an integer, got '4'"),
        ({"inner": {"size": True}}, "inner.size: expected an integer, got True"),
        ({"inner": {"size": 2.5}}, "inner.size: expected an integer, got 2.5"),
        ({"inner": {"size": 1}, "flag": 1}, "flag: expected true/false, got 1"),
        ({"inner": {"size": 1}, "rate": "fast"}, "rate: expected a number, got 'fast'"),
        ({"inner": {"size": 1}, "rate": "nan"}, "rate: expected a number, got 'nan'"),
        ({"inner": {"size": 1, "mode": "c"}}, "inner.mode: expected one of 'a', 'b', got 'c'"),
        ({"inner": {"size": 1}, "pair": [1, 2, 3]}, "pair: expected a list of 2 x a number, got 3 items"),
        ({"inner": {"size": 1}, "tags": "x"}, "tags: expected a list of a string, got 'x'"),
        ({"inner": {"size": 1}, "name": 5}, "name: expected a string or null, got 5"),
        ({"inner": 7}, "inner: expected a mapping, got 7"),
    ],
)
def test_bad_documents_name_the_key_and_what_is_valid(doc, message):
    with pytest.raises(SchemaError) as err:
        from_dict(Outer, doc)
    assert message in str(err.value)


def test_all_problems_are_reported_at_once():
    with pytest.raises(SchemaError) as err:
        from_dict(Outer, {"inner": {"size": "x", "extra": 1}, "flag": "yes"})
    assert len(err.value.problems) == 3


def test_integers_must_fit_64_bits():
    assert from_dict(Inner, {"size": 2**63 - 1}).size == 2**63 - 1
    with pytest.raises(SchemaError, match=r"size: expected an integer from -2\*\*63 to 2\*\*63 - 1, got 9223372"):
        from_dict(Inner, {"size": 2**63})


def test_shown_values_are_short_however_big_the_value():
    from trnrecipes.schema import shown

    assert shown("fast") == "'fast'" and shown(2.5) == "2.5"
    shared = ["lol"] * 9
    for _ in range(12):  # 9**12 leaves through shared references, as a YAML alias bomb builds them
        shared = [shared] * 9
    for value in ("x" * 10**6, list(range(10**6)), shared, 10**5000, {"k" * 1000: 1}):
        assert len(shown(value)) <= 80
    with pytest.raises(SchemaError) as err:
        from_dict(Outer, {"inner": {"size": 1}, "pair": shared, "k" * 10**5: 1})
    assert len(str(err.value)) < 400
