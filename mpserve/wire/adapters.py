"""A request's LoRA adapters: which of its model's declared adapters apply, each at a scale.

    Request.adapters ((NAME, scale), ...) ──check()──▶ names as declared names are written, each once, scales
                                                       finite within ±MAX_SCALE, at most MAX_ADAPTERS
    the clients' ``model`` BASE:NAME ──split_model()──▶ BASE, and NAME at scale 1 (vLLM's way of naming one)
    llama-server's ``lora`` [{"id": 0, "scale": 0.5}, {"name": "fr"}] ──from_lora()──▶ names, given the model's
                                                       adapters served and their ids (``Served``)
    the broker, against the model's adapters ──unknown()──▶ the 404 naming the ones served

An adapter's id is given once: the declared ones count from 0 in their order, one loaded while the server runs gets
the next id never given, and an unloaded one's id is not given again. So an id names one adapter for the server's
life, and a client that sends an id of an adapter since unloaded is refused, never served by another.

A selection is kept sorted by name: the same adapters at the same scales are one set, however a client wrote them,
so requests of one set batch together and share their cells (``mpserve.wire.salt`` digests it).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from mpserve.errors import BadRequest, UnknownAdapter
from mpserve.wire.messages import ADAPTER_NAME_PATTERN, MAX_ADAPTER_SCALE, MAX_ADAPTERS

MAX_SCALE = MAX_ADAPTER_SCALE
NAME_RE = re.compile(ADAPTER_NAME_PATTERN)  # no ':', where BASE:NAME splits
SEPARATOR = ":"

Selection = tuple[tuple[str, float], ...]


def check(adapters: Selection) -> None:
    """BadRequest naming the fix unless every name is well-formed and given once and every scale is in range."""
    names = [name for name, _ in adapters]
    if len(adapters) > MAX_ADAPTERS:
        raise BadRequest(f"a request applies at most {MAX_ADAPTERS} LoRA adapters, got {len(adapters)}")
    for name, scale in adapters:
        if not NAME_RE.match(name):
            raise BadRequest(f"LoRA adapter name {name!r} is not one an adapter can have; name one the model "
                             "serves (GET /v1/models lists them as MODEL:NAME)")
        if names.count(name) > 1:
            raise BadRequest(f"LoRA adapter {name!r} is given twice; give each adapter once, with its scale")
        if not (math.isfinite(scale) and -MAX_SCALE <= scale <= MAX_SCALE):
            raise BadRequest(f"LoRA adapter {name!r}: scale {scale!r} is out of range; give a number from "
                             f"{-MAX_SCALE:g} to {MAX_SCALE:g} (1: as trained, 0: off)")


def normal(adapters: Iterable[tuple[str, float]]) -> Selection:
    """The selection as one set: sorted by name, scales as floats, an adapter at scale 0 (off) left out."""
    return tuple(sorted((str(name), float(scale)) for name, scale in adapters if scale != 0))


def split_model(model: str | None) -> tuple[str | None, str | None]:
    """``BASE:NAME`` as (BASE, NAME); any other model name as (it, None)."""
    if model is None or SEPARATOR not in model:
        return model, None
    base, _, name = model.partition(SEPARATOR)
    return base, name


def selection(model: str | None, adapters: Mapping[str, float] | Sequence[Any] | None) -> tuple[str | None, Selection]:
    """A client's arguments as the request's model and adapters: ``model`` may be BASE:NAME; ``adapters`` a
    mapping of names to scales, or a list of names (scale 1) and (name, scale) pairs."""
    base, named = split_model(model)
    given: list[tuple[str, float]] = [(named, 1.0)] if named else []
    if isinstance(adapters, Mapping):
        given += [(str(k), _scale(v, str(k))) for k, v in adapters.items()]
    else:
        for item in adapters or ():
            if isinstance(item, str):
                given.append((item, 1.0))
            elif isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str):
                given.append((item[0], _scale(item[1], item[0])))
            else:
                raise BadRequest(f"adapters: got {item!r}; give names, (name, scale) pairs or {{name: scale}}")
    check(tuple(given))
    return base, normal(given)


class Served(Mapping[str, int]):
    """A model's adapters served now, name -> id, in the order of their ids (module docstring: ids are not reused)."""

    def __init__(self, names: Iterable[str] = ()) -> None:
        self._ids = {name: i for i, name in enumerate(names)}
        self._given = len(self._ids)  # ids given since start: the next one's

    def add(self, name: str) -> int:
        """``name`` served under a new id, which it returns."""
        self._ids[name], self._given = self._given, self._given + 1
        return self._ids[name]

    def remove(self, name: str) -> None:
        del self._ids[name]

    def __getitem__(self, name: str) -> int:
        return self._ids[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)


def from_lora(items: Any, served: Mapping[str, int], model: str) -> Selection:
    """llama-server's ``lora`` field: a list of ``{"id": N, "scale": S}`` (N: the adapter's id in ``served``, name
    -> id), or ``{"name": NAME, "scale": S}``; scale 1 when not given. BadRequest when malformed or for an id no
    adapter served has (never given, or its adapter unloaded), UnknownAdapter for a name the model does not have."""
    if not isinstance(items, list):
        raise BadRequest("'lora' must be a list like [{\"id\": 0, \"scale\": 0.5}]")
    given: list[tuple[str, float]] = []
    names = {i: name for name, i in served.items()}
    for item in items:
        if not isinstance(item, dict) or set(item) - {"id", "name", "scale"} or ("id" in item) == ("name" in item):
            raise BadRequest(f"'lora': got {item!r:.80}; each item is {{\"id\": N, \"scale\": S}} or "
                             "{\"name\": NAME, \"scale\": S}")
        if "id" in item:
            index = item["id"]
            if not isinstance(index, int) or isinstance(index, bool) or index not in names:
                raise BadRequest(f"'lora': model {model!r} serves no LoRA adapter with id {index!r} (an unloaded "
                                 "adapter's id is not reused); " + _served(model, served))
            name = names[index]
        else:
            name = item["name"]
            if not isinstance(name, str):
                raise BadRequest(f"'lora': name {name!r} must be a string")
        given.append((name, _scale(item.get("scale", 1.0), name)))
    check(tuple(given))
    return normal(given)


def unknown(adapters: Selection, served: Mapping[str, int], model: str) -> UnknownAdapter | None:
    """The error for the first of ``adapters`` the model does not serve; None when it serves them all."""
    missing = [name for name, _ in adapters if name not in served]
    if not missing:
        return None
    return UnknownAdapter(f"model {model!r} has no LoRA adapter {missing[0]!r}; " + _served(model, served))


def _served(model: str, served: Mapping[str, int]) -> str:
    if not served:
        return f"it serves none (declare them in its models[].adapters, or load one: mpserve adapters load {model} " \
               "NAME PATH)"
    return f"served adapters: {', '.join(f'{model}{SEPARATOR}{n} (id {i})' for n, i in served.items())}"


def _scale(value: Any, name: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise BadRequest(f"LoRA adapter {name!r}: scale {value!r} must be a number from {-MAX_SCALE:g} to "
                         f"{MAX_SCALE:g}")
    return float(value)
