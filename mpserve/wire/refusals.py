"""Refusals: msgspec's verdict on a body, in the project's words.

    msgspec.ValidationError "Expected `int` <= 1048576 - at `$.params.max_tokens`"
        ─▶ the path's field, its declared limits (Meta) and the value sent
        ─▶ BadRequest("'max_tokens' must be between 1 and 1048576, got 4096000")

The error is a BadRequest when the field is a client's parameter (its message class says so with
``REFUSED_AS``; an ``id`` or ``ticket`` never is one), else a ProtocolError: a peer that breaks the protocol.
Only a refused body is decoded a second time (untyped, for the value to name).
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from typing import Annotated, Any, TypeVar

import msgspec

from mpserve.errors import MpserveError, ProtocolError

T = TypeVar("T")
_PROTOCOL_FIELDS = frozenset({"id", "ticket"})  # what routes an answer: a sender that gets it wrong is broken
_KINDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "a boolean", "object": "a map",
          "array": "a list", "bytes": "bytes", "null": "nil"}
_STEP = re.compile(r"\.(\w+)|\[(\d+)\]")
_LENGTH = re.compile(r"`(\w+)` of length (<=|>=)? ?(\d+)")


def decode(decoder: msgspec.msgpack.Decoder[T], body: bytes | memoryview) -> T:
    """``body`` decoded by ``decoder`` (a typed one), or the error that names the problem."""
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise refusal(decoder.type, str(exc), lambda: msgspec.msgpack.decode(body)) from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"body is not valid msgpack: {exc}") from None
    except RecursionError:  # msgspec's own, for containers nested past its depth
        raise ProtocolError("body is not valid msgpack: nested too deeply") from None


def convert(values: Any, kind: type[T]) -> T:
    """Plain values (a parsed JSON object) as ``kind``, or the error that names the problem."""
    try:
        return msgspec.convert(values, kind)
    except msgspec.ValidationError as exc:
        raise refusal(kind, str(exc), lambda: values) from None


def refusal(root: Any, verdict: str, raw: typing.Callable[[], Any]) -> MpserveError:
    """The error for msgspec's ``verdict`` on a body decoded as ``root``; ``raw`` gives the body untyped."""
    detail, _, where = verdict.partition(" - at `$")
    steps = [name or int(index) for name, index in _STEP.findall(where.rstrip("`"))]
    owner, kind, key = _walk(root, steps)
    if not steps and not detail.startswith("Object"):
        want = detail[len("Expected `"):].partition("`")[0]
        return ProtocolError(f"body must be a msgpack {'array' if want == 'array' else 'map'}, got {_got(detail)}")
    if detail.startswith(("Object missing required field", "Object contains unknown field")):
        owner, key = kind, detail.split("`")[1]
    bad = getattr(owner, "REFUSED_AS", ProtocolError)
    error = ProtocolError if key in _PROTOCOL_FIELDS or not isinstance(key, str) else bad
    each = bool(steps) and isinstance(steps[-1], int)  # an item of a list field
    return error(_words(detail, key, kind, _value(raw, steps), owner, each))


def _walk(root: Any, steps: list[str | int]) -> tuple[Any, Any, str | int]:
    """The message class that owns the last named field on the path, the type at the path's end, and that
    field's name."""
    owner, kind, key = root, root, ""
    for step in steps:
        kind, _ = _strip(kind)
        if typing.get_origin(kind) is dict:  # a map's key: its value's type
            kind = typing.get_args(kind)[1]
        elif isinstance(step, str) and isinstance(kind, type) and (issubclass(kind, msgspec.Struct)
                                                                   or dataclasses.is_dataclass(kind)):
            owner, key = kind, step
            kind = typing.get_type_hints(kind, include_extras=True).get(step, Any)
        elif isinstance(step, int):
            args = typing.get_args(kind)
            kind = args[0] if len(args) == 2 and args[1] is Ellipsis or len(args) == 1 else \
                args[step] if step < len(args) else Any
    return owner, kind, key


def _strip(kind: Any) -> tuple[Any, list[msgspec.Meta]]:
    """A type without its Annotated layers and None: the type and the Meta limits it carried."""
    metas: list[msgspec.Meta] = []
    while True:
        if typing.get_origin(kind) is Annotated:
            metas += [m for m in kind.__metadata__ if isinstance(m, msgspec.Meta)]
            kind = kind.__origin__
        elif type(None) in typing.get_args(kind):
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        else:
            return kind, metas


def _value(raw: typing.Callable[[], Any], steps: list[str | int]) -> Any:
    try:
        value = raw()
        for step in steps:
            value = value[step]
    except Exception:  # a body too broken to walk: the message goes without its value
        return ...
    return value


def _words(detail: str, key: str | int, kind: Any, value: Any, owner: Any, each: bool) -> str:
    name = f"{'each ' if each else ''}'{key}'"
    if detail.startswith("Object missing required field"):
        return f"missing field {name}"
    if detail.startswith("Object contains unknown field"):
        word = getattr(owner, "FIELD_WORD", "field")
        return f"unknown {word} {name}; allowed: {list(getattr(owner, '__struct_fields__', ()))}"
    if detail.startswith("Expected `") and ", got `" in detail:
        want, got = detail[len("Expected `"):].split("`, got `")
        return f"{'' if each else 'field '}{name} must be {_kind(want)}, got {_kind(got.rstrip('`'))}"
    _, metas = _strip(kind)
    limits = {k: getattr(m, k) for m in metas for k in ("ge", "le", "min_length", "max_length")
              if getattr(m, k) is not None}
    if isinstance(value, float) and not math.isfinite(value):
        return f"{name} must be a finite number, got {value}"
    length = _LENGTH.search(detail)
    if length:
        unit = {"str": "characters", "bytes": "bytes"}.get(length[1], "items")
        size = len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else "?"
        if unit == "characters" and length[2] == "<=" and "min_length" not in limits:
            return f"{'' if each else 'field '}{name} is longer than {length[3]} characters, got {size}"
        span = length[3] if not length[2] else _span(limits.get("min_length"), limits.get("max_length"))
        return f"{name} must hold {span} {unit}, got {size}"
    shown = "" if value is ... else f", got {value!r:.60}"
    pattern = next((m.pattern for m in metas if m.pattern is not None), None)
    if pattern is not None and "matching regex" in detail:
        return f"{name} must match {pattern}{shown}"
    return f"{name} must be between {limits.get('ge')} and {limits.get('le')}{shown}"


def _span(low: Any, high: Any) -> str:
    if low is not None and high is not None:
        return f"{low} to {high}"
    return f"at least {low}" if low is not None else f"at most {high}"


def _kind(names: str) -> str:
    """msgspec's ``int | null`` as "an integer": nil, where allowed, goes without saying."""
    return " or ".join(_KINDS.get(n, n) for n in names.split(" | ") if n != "null" or names == "null")


def _got(detail: str) -> str:
    got = detail.rpartition(", got `")[2].rstrip("`")
    return _kind(got)

