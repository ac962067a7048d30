"""LoRA adapters: loaded onto the model once, chosen per sequence, applied to the context a step at a time.

    spec adapters {name: path} ──preload (the zygote, before the fork)──▶ {name: Loaded}   (instances share them)
                               ──Adapters(lib, model, base, loaded)──▶ the engine's set; a missing one loaded here
    load(name, path)   check_adapter (the file's header against the model's) ──▶ llama_adapter_lora_init
    unload(name)       llama_adapter_lora_free (the engine refuses while a sequence uses it)
    admit ──chosen(adapters)──▶ the request's set, canonical (sorted by name, no zero scale), every name known,
                                and its ``space``: what the sequence's cells are computed under
    step  ──Turns.next(sets of the running sequences)──▶ the set whose sequences run this step (a few in a row)
          ──apply(ctx, set)──▶ llama_set_adapters_lora, when the context has another (the first time:
                               heap.keep_large_blocks_mapped, as llama.cpp reallocates its buffers at each change)

llama.cpp applies adapters per context, not per sequence, so sequences whose sets differ cannot share a decode: they
take turns of a few steps (llama-server's rule: requests with different adapters are not batched together), round
robin among the sets that have work, and the sequences of one set decode together. A switch costs a rebuild of
llama.cpp's graphs and compute buffers, hence turns of several steps (``TURN_STEPS``) rather than one. Cells
computed under one set are not valid under another: ``space`` keys them (``cells``), b"" for the base model, mixed
with the request's salt by ``mpserve.wire.salt.reuse_key`` (the cache key's last hop), and the host store and slot
files keep base cells only. A space names the adapters' loads (``Loaded.serial``), not only
their names, so an adapter unloaded and loaded again from another file never meets cells computed under the first.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from mpserve.errors import BadRequest, UnknownModel
from mpserve.models.lora_file import check_adapter

from .heap import keep_large_blocks_mapped

AdapterSet = tuple[tuple[str, float], ...]
"""Adapter names and scales: a request's choice, canonical once ``chosen``; () is the base model."""

_SERIALS = itertools.count(1)  # loads in this process (and the zygote it was forked from)


@dataclass(frozen=True)
class Loaded:
    """An adapter loaded onto a model: its file, llama.cpp's handle, and which load of this process it is."""

    path: str
    handle: Any
    serial: int


def load(lib: Any, model: Any, base: str, name: str, path: str) -> Loaded:
    """Adapter ``name`` from ``path`` loaded onto ``model`` (the GGUF ``base``); BadRequest naming the problem."""
    check_adapter(name, path, base)
    handle = lib.llama_adapter_lora_init(model, path.encode())
    if not handle:
        raise BadRequest(f"adapter {name!r} ({path}): llama.cpp could not load it (its log says why); give a LoRA "
                         "adapter GGUF made for this model")
    return Loaded(path, handle, next(_SERIALS))


def preload(lib: Any, model: Any, base: str, paths: Mapping[str, str]) -> dict[str, Loaded]:
    """Every adapter of ``paths`` loaded onto ``model``, as a zygote does before it forks the instances."""
    return {name: load(lib, model, base, name, path) for name, path in paths.items()}


class Adapters:
    def __init__(self, lib: Any, model: Any, base: str, loaded: Mapping[str, Loaded]) -> None:
        """``loaded``: the adapters loaded onto ``model`` already (by the zygote)."""
        self._lib, self._model, self._base = lib, model, base
        self._loaded = dict(loaded)
        self._applied: tuple[float, ...] | None = ()  # serials and scales the context has now (a fresh one: none)
        self._switched = False  # whether the context has changed sets yet

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._loaded))

    def load(self, name: str, path: str) -> None:
        if name in self._loaded:
            raise BadRequest(f"adapter {name!r} is loaded already (from {self._loaded[name].path}); unload it first "
                             "to load another file under that name")
        self._loaded[name] = load(self._lib, self._model, self._base, name, path)

    def unload(self, name: str, ctx: Any) -> None:
        """Free adapter ``name``'s tensors (the caller made sure no sequence uses it); ``ctx`` lets go of it first."""
        loaded = self._known(name)
        self.apply(ctx, ())
        self._lib.llama_adapter_lora_free(loaded.handle)
        del self._loaded[name]

    def chosen(self, adapters: Iterable[tuple[str, float]]) -> tuple[AdapterSet, bytes]:
        """``adapters`` canonical, and the space of cells computed under them (b"": the base model's).
        UnknownModel for a name not loaded here, BadRequest for a name given twice."""
        given = list(adapters)
        names = [name for name, _ in given]
        if len(set(names)) != len(names):
            raise BadRequest(f"'adapters' names an adapter twice ({', '.join(names)}); give each once, with its scale")
        chosen = tuple(sorted((name, float(scale)) for name, scale in given if scale != 0.0))
        for name, _ in chosen:
            self._known(name)
        if not chosen:
            return (), b""
        identity = repr([(self._loaded[name].serial, scale) for name, scale in chosen]).encode()
        return chosen, hashlib.sha256(identity).digest()[:16]

    def apply(self, ctx: Any, adapters: AdapterSet) -> None:
        """Make ``adapters`` the context's, unless they are already."""
        loaded = [(self._loaded[name], scale) for name, scale in adapters]
        applied = tuple(v for entry, scale in loaded for v in (entry.serial, scale))
        if applied == self._applied:
            return
        n = len(loaded)
        handles = (self._lib.llama_adapter_lora_p_ctypes * n)(*(entry.handle for entry, _ in loaded)) if n else None
        scales = (ctypes.c_float * n)(*(scale for _, scale in loaded)) if n else None
        if self._lib.llama_set_adapters_lora(ctx, handles, n, scales) != 0:
            raise RuntimeError(f"llama_set_adapters_lora failed for {adapters}")
        if not self._switched:
            keep_large_blocks_mapped()
            self._switched = True
        self._applied = applied

    def _known(self, name: str) -> Loaded:
        loaded = self._loaded.get(name)
        if loaded is None:
            served = ", ".join(self.names()) or "none"
            raise UnknownModel(f"no adapter {name!r} is loaded for this model (adapters served: {served}); "
                               "choose one of those, or load it first")
        return loaded


TURN_STEPS = 4
"""The most steps in a row one adapter set runs while another waits: a switch makes the next llama_decode rebuild
llama.cpp's graphs and compute buffers (``llama_set_adapters_lora`` marks the context's scheduler for a reserve), so
a set keeps its turn a few steps, and a waiting set's tokens come at most that many steps per other set later."""


class Turns:
    """Which adapter set's sequences run a step: the sets with work take turns, round robin in a fixed order, each
    for up to ``steps`` steps in a row."""

    def __init__(self, steps: int = TURN_STEPS) -> None:
        self._steps = steps
        self._last: AdapterSet | None = None
        self._held = 0  # steps in a row ``_last`` has run

    @property
    def current(self) -> AdapterSet:
        """The set whose turn it is now (the last one given; none before the first)."""
        return self._last or ()

    def next(self, sets: Iterable[AdapterSet]) -> AdapterSet:
        waiting = sorted(set(sets))
        if not waiting:
            return ()
        if self._last in waiting and (len(waiting) == 1 or self._held < self._steps):
            self._held += 1
            return self._last
        later = [s for s in waiting if self._last is not None and s > self._last]
        self._last, self._held = later[0] if later else waiting[0], 1
        return self._last

