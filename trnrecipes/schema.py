"""Build typed dataclasses from plain YAML data, rejecting unknown keys and wrong types with readable errors.

Small on purpose (no pydantic): the rendering path must start in well under 0.5 s and import nothing heavy.
Supported field types: bool, int, float, str, Literal[...], X | None, list[X], tuple[X, ...], nested dataclasses,
and tagged unions of dataclasses (A | B whose first fields are one-value Literals: the tag picks the class).
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
import shlex
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

T = TypeVar("T")

SHOWN_CHARS = 80
INT64 = (-(2**63), 2**63 - 1)  # torch, numpy and bash arithmetic all read integers as 64-bit


def _bounded_repr() -> reprlib.Repr:
    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother, r.maxlong = 3, SHOWN_CHARS, SHOWN_CHARS, 40
    r.maxlist = r.maxtuple = r.maxdict = r.maxset = r.maxfrozenset = 6
    return r


_REPR = _bounded_repr()


def shell_word(value: object) -> str:
    """`value` as one shell word in a script or a command to paste: quoted where it holds spaces or shell characters."""
    return shlex.quote(str(value))


def shown(value: Any) -> str:
    """repr() of a user value for an error message, at most SHOWN_CHARS long. reprlib stops at a few items and
    levels, so a YAML alias bomb (a billion shared references) is never expanded just to be truncated."""
    try:
        text = _REPR.repr(value)
    except ValueError:  # an int with more digits than int -> str allows
        text = f"<an integer of {value.bit_length()} bits>" if isinstance(value, int) else "<unprintable>"
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def clipped(err: BaseException, limit: int = 200) -> str:
    """The first line of a library's error, capped: enough to say what is wrong, never a page of it."""
    text = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class Bound:
    """The valid range of a numeric field; `*_open`: that end itself is out. Non-finite numbers are always out."""

    low: float
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    def holds(self, value: float) -> bool:
        low_ok = value > self.low if self.low_open else value >= self.low
        high_ok = value < self.high if self.high_open else value <= self.high
        return math.isfinite(value) and low_ok and high_ok

    def __str__(self) -> str:
        if self.high == math.inf:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"


POSITIVE, NON_NEGATIVE = Bound(0, low_open=True), Bound(0)
FRACTION = Bound(0, 1, high_open=True)


class SchemaError(ValueError):
    """All problems found in one document, one per line."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


def from_dict(cls: type[T], data: Any, where: str = "") -> T:
    problems: list[str] = []
    value = _convert(cls, data, where, problems)
    if problems:
        raise SchemaError(problems)
    return value


def to_dict(obj: Any) -> Any:
    """Plain data for YAML/JSON: dataclasses become dicts, tuples become lists."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    return obj


def _name(where: str) -> str:
    return where or "<top level>"


def tagged_union(tp: Any) -> tuple[str, dict[Any, type]] | None:
    """(tag field, {tag value: class}) when `tp` is a union of dataclasses whose first field is a one-value
    Literal, e.g. the model section: `family: Literal["neox"]` picks NeoXConfig. None for any other type."""
    if get_origin(tp) not in (Union, types.UnionType):
        return None
    arms = get_args(tp)
    if not all(dataclasses.is_dataclass(a) for a in arms):
        return None
    tags = {dataclasses.fields(a)[0].name for a in arms}
    if len(tags) != 1:
        return None
    tag, classes = tags.pop(), {}
    for arm in arms:
        values = get_args(typing.get_type_hints(arm)[tag])
        if len(values) != 1:
            return None
        classes[values[0]] = arm
    return tag, classes


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if tagged_union(tp):
        return "a mapping"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(tp))
    if origin is list:
        return f"a list of {_describe(get_args(tp)[0])}"
    if origin is tuple and _variadic(tp):
        return f"a list of {_describe(get_args(tp)[0])}"
    if origin is tuple:
        return f"a list of {len(get_args(tp))} x {_describe(get_args(tp)[0])}"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string", type(None): "null"}.get(
        tp, str(tp)
    )


def _variadic(tp: Any) -> bool:
    """tuple[X, ...]: any number of X."""
    args = get_args(tp)
    return len(args) == 2 and args[1] is Ellipsis


def _convert(tp: Any, value: Any, where: str, problems: list[str]) -> Any:
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _convert_dataclass(tp, value, where, problems)
    if tagged_union(tp):
        return _convert_tagged(tp, value, where, problems)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        arms = [a for a in args if a is not type(None)]
        if len(arms) == 1 and dataclasses.is_dataclass(arms[0]) and isinstance(value, dict):
            return _convert_dataclass(arms[0], value, where, problems)  # a section or null: its own field's errors
        for arg in args:
            if arg is type(None):
                continue
            trial: list[str] = []
            converted = _convert(arg, value, where, trial)
            if not trial:
                return converted
        problems.append(f"{_name(where)}: expected {_describe(tp)}, got {shown(value)}")
        return None
    if origin is Literal:
        allowed = get_args(tp)
        # YAML turns `optlevel: 2` into an int and `x=2` overrides alike; compare as given.
        if value in allowed and type(value) in {type(a) for a in allowed}:
            return value
        problems.append(f"{_name(where)}: expected {_describe(tp)}, got {shown(value)}")
        return None
    if origin in (list, tuple):
        args = get_args(tp)
        if not isinstance(value, list | tuple):
            problems.append(f"{_name(where)}: expected {_describe(tp)}, got {shown(value)}")
            return None
        fixed = origin is tuple and not _variadic(tp)  # tuple[int, int] vs tuple[int, ...]
        if fixed and len(args) != len(value):
            problems.append(f"{_name(where)}: expected {_describe(tp)}, got {len(value)} items: {shown(value)}")
            return None
        item_types = args if fixed else [args[0]] * len(value)
        pairs = enumerate(zip(item_types, value, strict=True))
        items = [_convert(t, v, f"{where}[{i}]", problems) for i, (t, v) in pairs]
        return tuple(items) if origin is tuple else items
    return _convert_scalar(tp, value, where, problems)


def _convert_scalar(tp: Any, value: Any, where: str, problems: list[str]) -> Any:
    # bool is a subclass of int in Python; a YAML `true` must never pass as a node count, nor 1 as a flag.
    if tp is bool and isinstance(value, bool):
        return value
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        if INT64[0] <= value <= INT64[1]:
            return value
        problems.append(f"{_name(where)}: expected an integer from -2**63 to 2**63 - 1, got {shown(value)}")
        return None
    if tp is float and not isinstance(value, bool):
        if isinstance(value, float) and math.isfinite(value):
            return value
        if isinstance(value, int) and INT64[0] <= value <= INT64[1]:  # float(10**400) would raise OverflowError
            return float(value)
        # PyYAML reads `1e-5` (no dot) as a string; accept any finite number spelled as text.
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                number = math.nan
            if math.isfinite(number):
                return number
    if tp is str and isinstance(value, str):
        return value
    hint = " (quote it in YAML: '...')" if tp is str and isinstance(value, int | float) else ""
    problems.append(f"{_name(where)}: expected {_describe(tp)}, got {shown(value)}{hint}")
    return None


def _convert_tagged(tp: Any, value: Any, where: str, problems: list[str]) -> Any:
    tag, classes = tagged_union(tp)  # type: ignore[misc]
    key = f"{where}.{tag}" if where else tag
    valid = ", ".join(repr(v) for v in classes)
    if not isinstance(value, dict):
        problems.append(f"{_name(where)}: expected a mapping, got {shown(value)}")
    elif tag not in value:
        problems.append(f"{key}: required key is missing (one of {valid})")
    elif not any(value[tag] == v and type(value[tag]) is type(v) for v in classes):
        problems.append(f"{key}: expected one of {valid}, got {shown(value[tag])}")
    else:
        return _convert_dataclass(classes[value[tag]], value, where, problems)
    return None


def _convert_dataclass(cls: Any, value: Any, where: str, problems: list[str]) -> Any:
    if not isinstance(value, dict):
        problems.append(f"{_name(where)}: expected a mapping, got {shown(value)}")
        return None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    prefix = f"{where}." if where else ""
    for key in value:
        if key not in fields:
            name = key if isinstance(key, str) and len(key) <= SHOWN_CHARS else shown(key)
            problems.append(f"{prefix}{name}: unknown key; valid keys here: {', '.join(fields)}")
    kwargs = {}
    for name, field in fields.items():
        if name in value:
            kwargs[name] = _convert(hints[name], value[name], prefix + name, problems)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            problems.append(f"{prefix}{name}: required key is missing ({_describe(hints[name])})")
    if problems:
        return None
    return cls(**kwargs)
