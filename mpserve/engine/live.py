"""A running sequence's cells saved to the host store while it generates, so that the instance that goes on with it
after this one is lost (killed, stopped, its server gone) restores them instead of decoding its carried tokens again.
With ``reuse: exact`` only.

    step   ──save(running)──▶ each sequence that decoded for ``every_s`` since its last save: its cells (its prompt
                              and the tokens decoded so far) ──▶ HostStore.put_live under its live salt, replacing
                              the last one (skipped, and tried again at the next step, while the writer is busy)
    leave  ──save(running, leaving)──▶ every generating sequence's, the writes waited for, before the worker's
                              LEAVING (``BatchEngine.keep_running``): the broker hands them over at once
    admit  ──restore(slot, prompt, restorable, salt)──▶ HostStore.find(prompt + the carried tokens but the last, or
                              the last two where it may have ended the sequence: ``replay.restorable``) under the
                              live salt ── past the prompt? ──▶ load ──▶ write_state: the cells the sequence starts
                              from; ``replay.restored`` takes the carried tokens they hold, and the next
    finish ──forget(seq)──▶ HostStore.forget_live: its entries (and a lost instance's of the same sequence) removed

Why with ``reuse: exact`` only: there a carried token is decoded one a step, as it was first computed (``replay``),
so a resumed stream waits about as long as its tokens took to generate, and a stream handed over again and again
(a kill every few seconds) may never catch up. With ``reuse: any`` carried tokens are decoded in runs and a stream
goes on within a few steps.

Why the output stays exact: the lost instance computed these cells as the resumer would compute them, its prompt in
whole chunks (or reused in whole chunks, which are the same numbers) and each generated token as a lone row; restored,
they are the very bytes. The live salt (the request's own salt and its prompt's length) keeps them apart from prompt
entries, whose cells past the prompt's end were computed otherwise: a prompt that spells a live entry's tokens never
restores it, and a resumed request restores only cells computed one token a step from its own prompt's end on.

Not saved: a sequence under LoRA adapters (the store holds the base model's cells), one with images (their
placeholder ids do not say which image), one that scores its prompt (computed in other chunks), and one whose state
is too large for its share of the RAM tier (RAM_SHARE). A live entry held only up to tokens the resumer was never told
of (a kill between a save and the text's way to the broker) cannot serve it where saved states are not cut back
(sliding-window models): the carried tokens are then decoded one a step, as without this.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Iterable, Sequence

from .cells import Cells
from .host_store import HostStore
from .keeping import States, write_cells
from .sequence import Sequence as Running
from .settings import LIVE_SAVE_S

log = logging.getLogger("mpserve.worker")

LEAVING_S = 1.0
"""The most a leaving instance waits for its saves (the writer busy, its tier's lock held by another process): its
LEAVING, and so the hand-over, waits for them; past it, the requests not saved decode their tokens one a step."""

RAM_SHARE = 4
"""A sequence's state is saved only where ``parallel`` of them take at most 1/RAM_SHARE of the store's RAM tier: the
live entries of a full instance then leave most of the tier to prompts."""


def live_salt(salt: bytes, n_prompt: int) -> bytes:
    """The salt of a sequence's live entries: its request's salt and where its prompt ends (the cells after it were
    computed one token a step)."""
    return hashlib.blake2b(b"live\0" + n_prompt.to_bytes(4, "little") + salt, digest_size=16).digest()


class Live:
    def __init__(self, store: HostStore | None, states: States, cells: Cells, *, exact: bool,
                 every_s: float = LIVE_SAVE_S) -> None:
        self._store = store if exact else None
        self._states, self._cells, self._every_s = states, cells, every_s
        self.restored = 0  # counter: carried tokens whose cells were restored instead of decoded

    def save(self, running: Iterable[Running], leaving: bool = False) -> None:
        """Save the cells of each sequence of ``running`` that generated for ``every_s`` since its last save (or its
        admission); ``leaving``: of each that generated at all, the writes waited for (the instance leaves, and the
        broker hands them over)."""
        store, now = self._store, time.perf_counter()
        if store is None:
            return
        deadline = now + LEAVING_S
        for seq in running:
            due = leaving or now - seq.saved_at >= self._every_s
            if not due or not _saved_kind(seq) or seq.n_past <= len(seq.prompt):
                continue
            state, size = self._states.read_state(seq.slot)
            if not self._fits(store, size):
                seq.saved_at = math.inf  # its state only grows
            elif store.put_live(seq.kv_tokens(), state, size, live_salt(seq.salt, len(seq.prompt)),
                                wait=max(0.0, deadline - time.perf_counter()) if leaving else 0.0):
                seq.saved_at = now
        if leaving and not store.flush(max(0.0, deadline - time.perf_counter())):
            log.warning("the saves of the sequences this instance leaves with took over %g s; leaving without waiting "
                        "for the rest (their next instance decodes what they lack one token a step)", LEAVING_S)

    def _fits(self, store: HostStore, size: int) -> bool:
        return store.wants(size) and size * self._cells.parallel * RAM_SHARE <= store.ram_capacity

    def restore(self, slot: int, prompt: list[int], restorable: Sequence[int], salt: bytes) -> int:
        """The cells ``slot`` starts from, restored from the longest live entry of this prompt (under ``salt``) that
        holds more than the prompt and no more than the carried tokens ``restorable`` (``replay.restorable``); 0 where
        none does (the slot left as it was, or emptied where llama.cpp refused the state)."""
        store = self._store
        if store is None or not restorable:
            return 0
        wanted = prompt + list(restorable)
        entry, shared = store.find(wanted, live_salt(salt, len(prompt)))
        loaded = store.load(entry) if entry is not None and shared > len(prompt) else None
        if loaded is None:
            return 0
        if not write_cells(self._states, self._cells, slot, loaded, shared):
            self._cells.erase(slot)  # what the slot held is gone: its bookkeeping too
            return 0
        self.restored += shared - len(prompt)
        log.info("a resumed request restored the cells of %d of its carried tokens (saved as they were generated)",
                 shared - len(prompt))
        return shared

    def forget(self, seq: Running) -> None:
        """``seq`` ended: its live entries, and a lost instance's that it went on from, are of no more use."""
        saved = seq.carried or seq.saved_at > seq.admitted_at
        if self._store is not None and saved and _saved_kind(seq) and seq.n_past > len(seq.prompt):
            self._store.forget_live(seq.kv_tokens(), live_salt(seq.salt, len(seq.prompt)))


def _saved_kind(seq: Running) -> bool:
    """Whether ``seq``'s cells are of a kind saved live (module docstring)."""
    return not (seq.space or seq.images or seq.score_prompt)
