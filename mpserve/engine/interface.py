"""The engine interface: what a worker drives, and what an engine hands back.

    worker loop                       engine (BatchEngine for models, EchoEngine without one)
    ───────────                       ──────────────────────────────────────────────────────
    ASSIGN   ──admit(slot, …)──▶      queue the prompt in that slot (and the tokens another instance
                                      generated for it, when it resumes a request: ``carried``)
    CHUNK    ──tokens(slot)────▶      the token ids this sequence generated so far (not the carried ones;
                                      an end-of-generation token last, if one ended it)
    loop     ──step()──────────▶      one round for every running sequence; on_token per new piece
             ◀──[(slot, Completion)]  the sequences that ended in it
    CANCEL   ──cancel(slot)────▶      that sequence ends at the start of the next step (a parked one: drop(key))
    PREEMPT  ──park(slot, key)─▶      that sequence out of the batch, held whole; its slot free
    ASSIGN   ──resume(key, slot, …)─▶ a parked sequence back in a free slot, going on where it stopped
    TOKENIZE ──tokenize / token_bytes──▶  the model's vocabulary, between steps
    EMBED    ──embed(inputs)──▶   an ``Embedder`` (EmbeddingEngine, a model served with embedding: true)
    row      ──kv_cells(slot)──▶   the KV cells the slot holds (the slot table shows them)
    row      ──cache_stats()───▶   the host store's bytes, hits, misses, evictions
    DONE     ──take_cache_changes()──▶  its entries added and dropped since the last take (the CACHE frame)
    READY    ──cache_snapshot()──▶  all its entries (the CACHE frame of a registration)
    SLOT_ACTION ──save_slot / restore_slot / erase_slot──▶  an idle slot's cells to or from a file
    ADAPTER_ACTION ──load_adapter / unload_adapter──▶  a LoRA adapter loaded or freed (``adapter_names``: READY's;
                                                    ``slot_adapters``: what each slot row shows)

Engines know nothing of processes, sockets or the slot table; one thread calls them. ``on_token`` gets
each new piece of text and the number of tokens generated so far, and returns False to stop generating.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from mpserve.errors import BadRequest, MpserveError, UnknownModel
from mpserve.wire import protocol as wire
from mpserve.wire.protocol import ChatTemplate, GenerateParams

from .store_stats import NO_CACHE, CacheStats

OnToken = Callable[[str, int], bool]
"""Called with each new piece of text and the number of tokens generated so far; returns False to stop
generating (cancellation)."""


@dataclass(frozen=True)
class Completion:
    text: str
    finish_reason: str  # "length" | "stop" | "cancelled" | "error" (``error`` says why)
    prompt_tokens: int
    completion_tokens: int
    prompt_s: float
    generate_s: float
    reused_tokens: int = 0  # prompt tokens taken from KV cells instead of computed
    logprobs: wire.Logprobs | None = None  # asked for: those of tokens ``take_logprobs`` did not take
    draft_tokens: int = 0  # speculation: tokens proposed and verified
    accepted_tokens: int = 0  # of those, the ones kept
    error: MpserveError | None = None  # why it ended with an error: its grammar's step past the budget
    reasoning_tokens: int = 0  # of its tokens, those of its thinking (``mpserve.engine.thinking``)


class NoCells:
    """The Engine methods of an engine without KV cells to show, cache or save (echo, embeddings)."""

    def kv_cells(self, slot: int) -> int:
        return 0

    def cache_stats(self) -> CacheStats:
        return NO_CACHE

    def take_cache_changes(self) -> wire.CacheChanges:
        return NO_CHANGES

    def cache_snapshot(self) -> wire.CacheChanges:
        return NO_CHANGES

    def save_slot(self, slot: int, path: Path) -> int:
        raise BadRequest(_NO_CELLS)

    def restore_slot(self, slot: int, path: Path) -> int:
        raise BadRequest(_NO_CELLS)

    def erase_slot(self, slot: int) -> int:
        raise BadRequest(_NO_CELLS)

    def keep_running(self) -> None:
        return None


class NoAdapters:
    """The Engine methods of an engine that takes no LoRA adapters (echo, embeddings)."""

    def adapter_names(self) -> tuple[str, ...]:
        return ()

    def load_adapter(self, name: str, path: str) -> None:
        raise BadRequest(_NO_ADAPTERS)

    def unload_adapter(self, name: str) -> None:
        raise UnknownModel(f"no adapter {name!r} is loaded for this model (adapters served: none)")

    def slot_adapters(self, slot: int) -> tuple[tuple[str, float], ...]:
        return ()


def refuse_adapters(adapters: Sequence[tuple[str, float]]) -> None:
    """UnknownModel for a request that chose adapters, on an engine that has none."""
    if adapters:
        raise UnknownModel(f"no adapter {adapters[0][0]!r} is loaded for this model (adapters served: none)")


NO_CHANGES = wire.CacheChanges()
_NO_CELLS = "this model keeps no KV cells in its slots to save, restore or erase"
_NO_ADAPTERS = "this backend takes no LoRA adapters; give adapters to a model served by llama.cpp"


class Engine(Protocol):
    """``parallel`` slots, each running at most one sequence."""

    parallel: int
    chat: ChatTemplate

    def free_slots(self) -> list[int]: ...

    def admit(self, slot: int, prompt: str | list[int], params: GenerateParams, on_token: OnToken,
              carried: Sequence[int] = (), adapters: Sequence[tuple[str, float]] = (), salt: bytes = b"",
              alone: bool = False, images: Sequence[bytes] = ()) -> None:
        """``prompt``: text (tokenized with BOS), or token ids taken as they are; ``images``: encoded images, each
        where the text's next media marker is (``mpserve.engine.media``); ``carried``: the tokens a
        lost instance generated for this request, replayed before it goes on; ``adapters``: the LoRA adapters
        (loaded names) and scales it runs under (UnknownModel for a name not loaded); ``salt``: its reuse namespace
        (``mpserve.wire.salt``), the only cells it may start from being those computed under the same; ``alone``:
        it goes ahead of the running sequences (higher priority): its first prompt chunk is the next step's only
        decode."""

    def adapter_names(self) -> tuple[str, ...]:
        """The LoRA adapters loaded, by name."""

    def load_adapter(self, name: str, path: str) -> None:
        """Load the LoRA adapter GGUF ``path`` as ``name`` (BadRequest naming what is wrong with it)."""

    def unload_adapter(self, name: str) -> None:
        """Free adapter ``name`` (BadRequest while a sequence runs under it; UnknownModel if not loaded)."""

    def slot_adapters(self, slot: int) -> tuple[tuple[str, float], ...]:
        """The adapters ``slot``'s running (or last) sequence runs under."""


    def tokens(self, slot: int) -> Sequence[int]:
        """The tokens the sequence in ``slot`` sampled so far (not the carried ones), then the
        end-of-generation token if one ended it."""
    def kv_cells(self, slot: int) -> int:
        """The KV cells ``slot`` holds now (its running sequence's, or what its last request left)."""

    def cache_stats(self) -> CacheStats:
        """The host store's size and counters."""

    def take_cache_changes(self) -> wire.CacheChanges:
        """The host store's entries added (with their summaries) and dropped since the last take."""

    def cache_snapshot(self) -> wire.CacheChanges:
        """All the host store's entries with a summary, as added; the next take starts from here."""

    def take_logprobs(self, slot: int) -> wire.Logprobs | None:
        """The log-probabilities of the tokens the sequence in ``slot`` generated since the last take (when
        its request asked for them)."""

    def save_slot(self, slot: int, path: Path) -> int:
        """Write idle ``slot``'s KV cells and tokens to ``path``; the tokens saved."""

    def restore_slot(self, slot: int, path: Path) -> int:
        """Replace idle ``slot``'s cells with those ``path`` holds (BadRequest, the slot unchanged, for a file
        that does not match); the tokens restored."""

    def erase_slot(self, slot: int) -> int:
        """Drop idle ``slot``'s cells; how many it held."""

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        """``text``'s tokens, special tokens written in it parsed; ``add_special``: BOS first, if the model
        adds one."""

    def token_bytes(self, token: int) -> bytes:
        """The text of ``token`` (special tokens as written); BadRequest for an id outside the vocabulary."""

    def cancel(self, slot: int) -> None: ...

    def park(self, slot: int, key: str) -> bool:
        """Take the sequence in ``slot`` out of the batch, held under ``key``; its slot is free. False if nothing
        runs there (it ended) or it is being cancelled."""

    def resume(self, key: str, slot: int, on_token: OnToken) -> bool:
        """Put the sequence parked under ``key`` back into free ``slot``, its text going to ``on_token``: it goes
        on exactly where it stopped. False if none is parked under ``key`` (the caller admits the request)."""

    def drop(self, key: str) -> None:
        """Forget the sequence parked under ``key``, if one is."""

    def step(self) -> list[tuple[int, Completion]]: ...

    def keep_running(self) -> None:
        """The instance leaves with sequences running, which the broker hands over: save what another instance
        restores to go on with them (``mpserve.engine.live``), and wait for the writes."""

    def close(self) -> None: ...


@runtime_checkable
class Embedder(Protocol):
    """An engine that computes embeddings (``mpserve.engine.embed``)."""

    dim: int
    reranker: bool  # pooling rank: rank, not embed

    def embed(self, inputs: list[str | list[int]]) -> tuple[np.ndarray, int]:
        """One L2-normalised float32 vector per input (a text, or token ids), and the tokens there were."""

    def rank(self, query: str, documents: list[str]) -> tuple[np.ndarray, int]:
        """A reranker's (pooling rank) score of each document against ``query``, and the tokens there were."""


@dataclass(frozen=True)
class BatchStats:
    """Counters since the engine was built. ``decode_s`` is time inside llama_decode; the rest of
    ``step_s`` is scheduling, sampling, detokenizing and the on_token callbacks."""

    steps: int
    step_s: float
    decode_s: float
    prompt_tokens_computed: int
    prompt_tokens_reused: int  # from the admitting slot's own cells or, copied, from another slot's
    generated_tokens: int
    prefix_copies: int  # admissions that copied another slot's cells
    prompt_tokens_restored: int  # of those reused: restored from the host store
    draft_tokens: int = 0  # proposed by speculation and verified
    accepted_tokens: int = 0  # of those, the ones the sequences kept
    carried_tokens_restored: int = 0  # a resumed request's carried tokens whose cells were restored (``live``)
