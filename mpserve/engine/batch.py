"""Continuous batching: one llama.cpp context decoding several sequences in one batch.

A context that decodes K sequences in one ``llama_decode`` call reads the model's weights once for all K of them,
which is where a memory-bound decode spends its time; K sequences cost little more than one. ``BatchEngine`` is
the compute core for that: it knows nothing of processes or sockets. A caller (the worker) admits requests into
free slots and calls ``step`` in a loop; each module below does one job of it:

    admit(slot, prompt, params, on_token)
      context.tokenize_prompt ─▶ keeping.keep (what the cut loses) ─▶ cells.take_cells ─▶ keeping.restore
      (a resumed request: live.restore, its cells saved as it generated, first) ─▶ cells.start
      ─▶ scheduler.add(Sequence)                                                (sequence: the request in its slot)
    step()
      schedule  scheduler.cancelled / cells.catch_up / scheduler.decoding, decodes, chunks (+ drafts to verify:
                speculation; a draft model's own context: draft; + a resumed request's carried tokens: replay)
      decode    context.decode: one llama_decode per group of decoding sequences, one per prompt chunk (at most
                ``step_budget_tokens`` while others decode; a chunk is never cut)
      sample    each sequence with logits, with its own sampler chain (sampling); text and stop strings; on_token
                per token; prompts equal to one just computed take its cells (cells.share)
      keep      keeping.save_computed: a prompt's cells to the host store as its chunks are computed; live.save: a
                generating sequence's, now and then (``reuse: exact``), for an instance that goes on with it
      ─▶ [(slot, Completion)] of the sequences that ended
    cancel(slot)   the sequence ends at the start of the next step
    load_adapter / unload_adapter   LoRA adapters (``adapters``): a sequence runs under the set its request chose;
                   the sets take turns of a few steps (llama.cpp applies adapters per context), and cells computed
                   under one set are reused by the same set only
    park(slot, key) / resume(key, slot, on_token)   a running sequence out of the batch and back (``parking``)

Slots are llama.cpp sequence ids 0..parallel-1, and the context holds ``parallel * n_ctx`` KV cells. By default
every slot has a stream of ``n_ctx`` cells of its own (llama-server's layout with ``--parallel``): a token attends
over its own sequence's cells only. ``kv_unified=True`` puts all cells in one pool instead: a token's attention then
spans the cells of every sequence (masked), which costs more with long contexts, while a step with short ones is a
little faster (bench/batch_bench.py measures both). Either way a slot holds at most ``n_ctx`` cells, so a sequence
never runs out of cells because of another, and a slot keeps the cells of its last request after it finishes
(``cells``): a new prompt that starts with the same tokens skips recomputing them (reported as ``reused_tokens``);
a longer shared prefix in another slot is copied; the host store (``keeping``) restores one no slot holds.

What a prompt may start from is the ``reuse`` mode. ``any`` (the default, llama-server's behaviour): the longest
prefix any cells hold, at any length, generated tokens included, so the next turn of a chat computes only what is
new. ``exact``: whole prompt chunks only, so that output equals a fresh computation. Prompts are computed in chunks
of PROMPT_CHUNK tokens from position 0, each chunk in a llama_decode of its own: the decodes ``llama_cpp.Llama``
makes for the same prompt. llama.cpp's CPU kernels give a token slightly different numbers depending on how many
tokens its batch holds (with quantized weights, enough to change a greedy choice), so a prompt's tail computed after
reused cells would not give what the whole prompt computed at once gives. With ``exact`` only whole chunks are
reused, copied or restored, so the tokens computed after them are computed in the very chunks a fresh computation
uses, and a sequence with a long context decodes in a llama_decode of its own (``scheduler.decodes``). Either way
the last prompt token is computed (its logits pick the first token), and cells that the memory no longer holds are
never reused (``cells.holds_cells``). A slot's own cells are all held (a context's sliding-window layers keep every
cell: llama.cpp's full-size SWA cache, its default outside its server), and so are a restored state's when the
prompt extends all of its tokens; but a saved state holds on its sliding-window layers only the cells its next
token attends to, and a recurrent state only its last position, so such states are restored only whole (the host
store's ``cut_back``).

A request asking for its prompt's log-probabilities (``prompt_logprobs``, for echo) needs a logits row for every
prompt token: its prefill chunks (of SCORED_CHUNK tokens, which bounds the logits buffer) request logits on all
their rows, scored after the decode (``score_prompt``); it never starts from cached cells, its own or copied
(their rows are gone), and its cells are never reused.

With ``reuse: exact``, greedy output equals ``llama_cpp.Llama.create_completion(prompt, temperature=0)`` with the
same flash attention setting: the same tokens (BOS, then the prompt tokenized without specials added and with
special tokens parsed), the same context settings, the same prompt decodes, the same sampler chain
(``mpserve.engine.sampling``). Decoding K sequences in one batch relies on a row's logits not depending on the
other rows: true of quantized weights' small batches of one token per sequence with short contexts, never of float
weights, whose sequences decode one a decode (``scheduler.together_rows``, docs/how-it-works/exact-output.md). Not
thread-safe: one thread admits, cancels and steps; an on_token callback may call ``cancel`` but not ``admit``.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import itertools
import logging
import random
import time
from collections import deque
from pathlib import Path
from typing import Any

from mpserve.counts import counted
from mpserve.errors import BadRequest
from mpserve.structured import grammar_source
from mpserve.wire import protocol as wire
from mpserve.wire.prefix import routed
from mpserve.wire.protocol import GenerateParams
from mpserve.wire.salt import reuse_key

from . import media, replay, slot_file
from .adapters import Adapters, AdapterSet, Loaded, Turns
from .cells import Cells
from .context import Context
from .copy_cost import measure as measure_copy_cost
from .draft import DraftModel, Want
from .grammar import GrammarCache
from .interface import BatchStats, Completion, OnToken
from .keeping import Keeping, open_store
from .kv_events import Held, held, stored
from .live import Live
from .logprobs import LogprobsRecorder, score_prompt
from .parking import Parking
from .sampling import TextStream
from .scheduler import Scheduler, together_rows
from .sequence import PROMPT_CHUNK, Phase, Sequence, next_chunk
from .settings import EngineSettings
from .speculation import Drafter, RowCosts, exact_rows, verify
from .store_stats import CacheStats
from .thinking import Phases, sampler_for

log = logging.getLogger("mpserve.worker")


class BatchEngine:
    def __init__(self, settings: EngineSettings, model: Any = None,
                 adapters: collections.abc.Mapping[str, Loaded] | None = None, projector: Any = None) -> None:
        """``model``: the llama.cpp model of ``settings.path``, loaded already (by the zygote this process was forked
        from, ``mpserve.worker.zygote``), used instead of loading the file; the engine owns it from then on.
        ``adapters``: LoRA adapters loaded onto ``model`` already (the zygote's); those of ``settings.adapters``
        not among them are loaded here. ``projector``: the model's image projector, loaded with it (the zygote's)."""
        self.n_ctx, self.parallel = settings.n_ctx, settings.parallel
        self._exact = settings.exact
        self._rng = random.Random(settings.seed)
        self._steps, self._step_s = 0, 0.0
        self._computed = self._generated = self._drafted = self._accepted = 0
        self._draft: DraftModel | None = None  # speculative type draft
        self._context = context = Context(settings, model, projector)
        self._exact_rows = exact_rows(context.repacked)
        self._scheduler = Scheduler(settings.step_budget_tokens, exact=self._exact, kv_unified=settings.kv_unified,
                                    exact_rows=together_rows(self._exact_rows, context.float_weights))
        self._grammars, self._reasoning = GrammarCache(context.vocab, settings.grammar_step_s), settings.reasoning
        self._speculative = settings.speculative
        if self._speculative is not None and context.recurrent:
            log.warning("speculative decoding is off: this model's recurrent state cannot drop rejected drafts")
            self._speculative = None
        self._row_costs = RowCosts()
        self._turns = Turns()
        self._last_adapters: list[AdapterSet] = [()] * self.parallel
        self._adapters = Adapters(context.lib, context.model, settings.path, adapters or {})
        try:
            for name, path in settings.adapters:
                if name not in self._adapters.names():
                    self._adapters.load(name, path)
            if self._speculative is not None and self._speculative.model is not None:
                self._draft = DraftModel(context.lib, self._speculative.model, settings.path, context.model,
                                         context.params(PROMPT_CHUNK, False), settings.n_gpu_layers, settings.repack,
                                         PROMPT_CHUNK)
            store = open_store(settings, context.identity, context.cut_back, context.lib.__version__,
                               context.lib.LLAMA_STATE_SEQ_VERSION)
        except BaseException:
            if self._draft is not None:
                self._draft.close()
            self._grammars.close()
            context.close()
            raise
        self._cells = Cells(context, self.parallel, self._scheduler.running, exact=self._exact,
                            kv_unified=settings.kv_unified, n_swa=context.n_swa, has_store=store is not None)
        self._keeping = Keeping(store, self._cells, context, exact=self._exact, cut_back=context.cut_back)
        self._live = Live(store, context, self._cells, exact=self._exact, every_s=settings.live_save_s)
        self._parking = Parking(context, self._cells, self._scheduler)
        self.chat = context.chat
        context.warm_up()
        if not settings.kv_unified and self.parallel > 1:  # a stream per slot: a copy moves a whole one
            self._cells.copy_cost = measure_copy_cost(context)
            log.debug("a prompt token costs %.3f ms, a copy of a slot's cells %.3f ms",
                      self._cells.copy_cost.token_s * 1e3, self._cells.copy_cost.copy_s * 1e3)

    # --- slots --------------------------------------------------------------------------------------

    @property
    def active(self) -> int:
        return len(self._scheduler.running)

    def free_slots(self) -> list[int]:
        return [slot for slot in range(self.parallel) if slot not in self._scheduler.running]

    def kv_cells(self, slot: int) -> int:
        """The KV cells ``slot`` holds now: its running sequence's, or what its last request left."""
        return self._cells.kv_cells(slot)

    def kv_held(self) -> list[Held]:
        """What each slot's cells hold, for the KV events (``kv_events.held``)."""
        return held(self._cells, [self.slot_adapters(slot) for slot in range(self.parallel)])

    def kv_stored(self) -> list[tuple[str, Held | None]]:
        """The host-store entries written and removed since the last call, for the KV events (``kv_events.stored``)."""
        return stored(self._keeping.store)

    def best_slot(self, prompt: str, salt: bytes = b"") -> tuple[int, int]:
        """The free slot whose cells share the longest prefix with ``prompt`` under ``salt``, and how many prompt
        tokens ``admit`` would reuse there (``Cells.best_slot``)."""
        free = self.free_slots()
        return self._cells.best_slot(free, self._context.tokenize_prompt(prompt) if free else [], salt)

    # --- the host store ------------------------------------------------------------------------------

    def cache_stats(self) -> CacheStats:
        return self._keeping.stats()

    def take_cache_changes(self) -> wire.CacheChanges:
        return self._keeping.take_changes()

    def cache_snapshot(self) -> wire.CacheChanges:
        return self._keeping.snapshot()

    # --- slot files ----------------------------------------------------------------------------------

    def save_slot(self, slot: int, path: Path) -> int:
        """Write idle ``slot``'s cells and their tokens to ``path`` (``mpserve.engine.slot_file``); the tokens."""
        self._idle(slot)
        if self._cells.spaces[slot]:
            raise BadRequest(f"slot {slot}'s cells were computed under LoRA adapters, and slot files hold the base "
                             "model's only; save a slot that served a request without adapters")
        tokens = self._cells.cached[slot]
        state, size = self._context.read_state(slot)
        if not tokens or not size:
            raise BadRequest(f"slot {slot} holds no KV cells to save")
        slot_file.write(path, slot_file.SlotFile(self._context.identity, tokens, self._cells.whole[slot], state, size))
        return len(tokens)

    def restore_slot(self, slot: int, path: Path) -> int:
        """Replace idle ``slot``'s cells with those saved in ``path``; the tokens restored. A file that does not
        match this instance is refused (BadRequest saying why) and the slot keeps its cells."""
        self._idle(slot)
        saved = slot_file.read(path, self._context.identity)
        if len(saved.tokens) >= self.n_ctx:
            raise BadRequest(f"slot file {path.name!r} holds {len(saved.tokens)} tokens; a slot here holds "
                             f"{self.n_ctx}")
        if not self._context.write_state(slot, saved.state, saved.size):
            self.erase_slot(slot)
            raise BadRequest(f"llama.cpp refused the KV cells of slot file {path.name!r}; the slot is empty")
        self._cells.set(slot, saved.tokens, saved.whole)
        return len(saved.tokens)

    def erase_slot(self, slot: int) -> int:
        """Drop idle ``slot``'s cells; how many it held."""
        self._idle(slot)
        return self._cells.erase(slot)

    # --- LoRA adapters -------------------------------------------------------------------------------

    def adapter_names(self) -> tuple[str, ...]:
        """The adapters loaded here, by name."""
        return self._adapters.names()

    def load_adapter(self, name: str, path: str) -> None:
        """Load the LoRA adapter GGUF ``path`` as ``name``; BadRequest naming what is wrong with it."""
        self._adapters.load(name, path)

    def unload_adapter(self, name: str) -> None:
        """Free adapter ``name``; BadRequest while a sequence runs under it (its requests drain first)."""
        users = sum(1 for seq in self._scheduler.running.values() if any(n == name for n, _ in seq.adapters))
        if users:
            raise BadRequest(f"adapter {name!r} is in use by {counted(users, 'running request')}; stop sending it "
                             "requests and unload it once they are done")
        self._adapters.unload(name, self._context.ctx)

    def slot_adapters(self, slot: int) -> AdapterSet:
        """The adapters ``slot``'s sequence runs under (its last one's, when idle)."""
        seq = self._scheduler.running.get(slot)
        return seq.adapters if seq is not None else self._last_adapters[slot]

    def _idle(self, slot: int) -> None:
        if not 0 <= slot < self.parallel:
            raise BadRequest(f"slot {slot} is not a slot of this instance (0..{self.parallel - 1})")
        if slot in self._scheduler.running:
            raise BadRequest(f"slot {slot} is running a request; try again when it is idle")

    # --- requests -----------------------------------------------------------------------------------

    def admit(self, slot: int, prompt: str | list[int], params: GenerateParams, on_token: OnToken,
              carried: collections.abc.Sequence[int] = (), adapters: collections.abc.Sequence[tuple[str, float]] = (),
              salt: bytes = b"", alone: bool = False, images: collections.abc.Sequence[bytes] = ()) -> None:
        """Start ``prompt`` in free slot ``slot``; its prompt is computed by the coming steps. A prompt of token ids is
        taken as it is (no BOS added), as create_completion takes one. ``carried``: the tokens another instance
        generated for this request before it was lost. They are decoded after the prompt, taken instead of sampled (so
        the sampler's penalties see them): with ``reuse: exact`` one a step, as they were first computed, with ``any``
        in runs (``replay``). Their text opens the completion without reaching ``on_token`` (the client has it, and
        their log-probabilities), and what the text stream held back at the cut stays held back: the sequence
        continues where it was cut. ``adapters``: the LoRA adapters (names loaded
        here) and scales it runs under (UnknownModel for a name not loaded). ``salt``: its reuse namespace
        (``mpserve.wire.salt``): it starts from cells (its slot's, another's, the host store's) computed under the same
        salt only; under adapters, the salt is the request's with their loads mixed in (``reuse_key``), so that cells
        computed under other adapters are never reused whatever salt the broker gave. ``alone``: its first prompt chunk
        is the next step's only decode (``Scheduler.urgent``). ``images``: the images its markers place (``media``)."""
        if not 0 <= slot < self.parallel or slot in self._scheduler.running:
            raise ValueError(f"slot {slot} is not a free slot of 0..{self.parallel - 1}")
        context, keeping = self._context, self._keeping
        chosen, space = self._adapters.chosen(adapters)
        tokens, images_at = media.prompt_tokens(context, prompt, images, params.prompt_logprobs)
        context.in_vocabulary([t for t, _ in params.logit_bias], "logit_bias")
        source = grammar_source(params.grammar, params.json_schema)
        grammar = self._grammars.sampler(source) if source is not None else None  # BadRequest if unparsable
        if not tokens:
            raise BadRequest("the prompt is empty and the model has no BOS token to start from")
        if len(tokens) >= self.n_ctx:
            raise BadRequest(f"the prompt is {len(tokens)} tokens; the context holds {self.n_ctx} per sequence")
        max_tokens = min(params.max_tokens, self.n_ctx - len(tokens))
        if len(carried) > max_tokens:
            raise BadRequest(f"{len(carried)} tokens carried over, more than the {max_tokens} to generate")
        # prompt_logprobs needs every prompt row, which cached cells no longer have (a hand-over's client has
        # the prompt's already: carried tokens skip it)
        score_prompt = params.prompt_logprobs and params.logprobs is not None and not carried
        key = reuse_key(salt, space)
        restorable = () if images_at else replay.restorable(carried, params.stop, max_tokens, context)
        cells = self._starting_cells(slot, tokens, key, score_prompt, space, restorable)
        reused = min(cells, len(tokens))
        self._cells.start(slot, tokens, reused, routed(prompt, images) if isinstance(prompt, str) else "", key, space,
                          images_at)
        seed = params.seed if params.seed is not None else self._rng.randrange(2**32 - 1)
        seq = Sequence(
            slot, tokens, reused, max_tokens,
            sampler_for(context, params, seed, grammar, self._reasoning, self.n_ctx),  # thinking's Phases too
            TextStream(params.stop, strip_leading_space=not prompt), on_token, key,
        )
        self._equip(seq, params, score_prompt)
        seq.carried, seq.replay = len(carried), deque(carried)
        if cells > reused:  # carried tokens' cells too
            replay.restored(seq, context, cells)
        seq.marks = () if space else media.outside(images_at, keeping.marks(tokens, reused, score_prompt))  # they save
        seq.adapters, seq.space, seq.images = chosen, space, images_at  # cells in the store (not inside an image)
        seq.alone = alone
        self._last_adapters[slot] = chosen
        self._scheduler.add(seq)

    def _starting_cells(self, slot: int, tokens: list[int], key: bytes, score_prompt: bool, space: bytes,
                        restorable: collections.abc.Sequence[int]) -> int:
        """The cells a prompt admitted into ``slot`` starts from: its slot's own, or more of them restored from the host
        store (base cells only); for a resumed request, its cells saved as it generated (``live``), past its prompt."""
        keeping = self._keeping
        keeping.keep(slot, tokens, key)
        if score_prompt:
            self._context.seq_rm(slot, -1, -1)
            return 0
        if not space and (live := self._live.restore(slot, tokens, restorable, key)):
            return live
        own = self._cells.take_cells(slot, tokens, key)
        return own if space else keeping.restore(slot, tokens, own, key)

    def _equip(self, seq: Sequence, params: GenerateParams, score_prompt: bool) -> None:
        """Give ``seq`` what its parameters ask for besides sampling: a log-probabilities recorder, a drafter."""
        if params.logprobs is not None:
            seq.logprobs = LogprobsRecorder(params.logprobs)
            seq.score_prompt = score_prompt
            if score_prompt and seq.prompt[0] not in self._context.bos:  # a first token nothing precedes (BOS is
                seq.logprobs.add_unscored(seq.prompt[0], self._context.piece_bytes)  # not echoed)
        if self._speculative is not None and params.speculative_n_max != 0:
            n_max = min(self._speculative.n_max, params.speculative_n_max or self._speculative.n_max)
            seq.drafter = Drafter(dataclasses.replace(self._speculative, n_max=n_max,
                                                      n_min=min(n_max, self._speculative.n_min)))

    def tokens(self, slot: int) -> collections.abc.Sequence[int]:
        """The tokens the sequence in ``slot`` sampled so far (not the carried ones), then the end-of-
        generation token if one ended it: carried over, it says that the text was all sent."""
        seq = self._scheduler.running.get(slot)
        if seq is None:
            return ()
        return seq.generated[seq.carried:] + ([seq.eog] if seq.eog >= 0 else [])

    def cancel(self, slot: int) -> None:
        """End the sequence in ``slot`` at the start of the next step (finish_reason "cancelled").
        A slot with nothing running is left alone: the request may have just finished."""
        seq = self._scheduler.running.get(slot)
        if seq is not None:
            seq.cancel_requested = True

    # --- parking: a sequence out of the batch for a while, and back ---------------------------------

    def park(self, slot: int, key: str) -> bool:
        """The sequence running in ``slot`` out of the batch, held under ``key`` (``parking``)."""
        return self._parking.park(slot, key)

    def resume(self, key: str, slot: int, on_token: OnToken) -> bool:
        """The sequence parked under ``key`` back into free ``slot`` (``parking``)."""
        resumed = self._parking.resume(key, slot, on_token)
        if resumed:
            self._last_adapters[slot] = self._scheduler.running[slot].adapters
        return resumed

    def drop(self, key: str) -> None:
        """Forget the sequence parked under ``key``, if one is."""
        self._parking.drop(key)

    def take_logprobs(self, slot: int) -> wire.Logprobs | None:
        """The log-probabilities of the tokens ``slot``'s sequence generated since the last take."""
        seq = self._scheduler.running.get(slot)
        return seq.logprobs.take() if seq is not None and seq.logprobs is not None else None

    # --- the step: schedule, decode, sample, keep ----------------------------------------------------

    def step(self) -> list[tuple[int, Completion]]:
        """One llama_decode for the decoding sequences, one per prompt chunk; returns the sequences that
        ended in them."""
        started, scheduler = time.perf_counter(), self._scheduler
        done = [self._finish(seq, "cancelled") for seq in scheduler.cancelled()]
        if self.parallel > 1:
            self._cells.catch_up(scheduler.prefilling)
        urgent = scheduler.urgent(self._turns.current)
        if urgent is not None:  # ahead of the rest, under its own adapters
            urgent.alone = False
            self._adapters.apply(self._context.ctx, urgent.adapters)
            decoding, chunks = [], [urgent]
        else:
            turn = self._turns.next(seq.adapters for seq in scheduler.running.values())
            self._adapters.apply(self._context.ctx, turn)
            decoding = [seq for seq in scheduler.decoding() if seq.adapters == turn]
            chunks = scheduler.chunks(bool(decoding), turn)
        if decoding:
            self._propose(decoding)
            scheduler.runs(decoding, len(self._context.batch.token) - sum(1 + len(seq.drafts) for seq in decoding))
        for together in scheduler.decodes(decoding):
            done += self._decode_tokens(together)
        for seq in chunks:
            done += self._decode_chunk(seq)
        self._live.save(scheduler.running.values())
        self._steps += 1
        self._step_s += time.perf_counter() - started
        return done

    def _decode_tokens(self, together: list[Sequence]) -> list[tuple[int, Completion]]:
        """One llama_decode of each sequence's next token, then its drafts (if any) at the positions after it;
        sample them all."""
        batch = self._context.batch
        batch.n = 0
        for seq in together:
            seq.output_row = batch.add(seq.next_token, seq.n_past, seq.slot)
            for i, token in enumerate(seq.drafts, 1):
                batch.add(token, seq.n_past + i, seq.slot)
            if seq.ahead:  # carried tokens, taken after the decode (``replay``)
                batch.add_run(list(itertools.islice(seq.replay, seq.ahead)), seq.n_past + 1, seq.slot)
            seq.n_past += 1 + seq.ahead
        rows, seconds = batch.n, self._context.decode()
        if self._speculative is not None:
            self._row_costs.observe(rows, seconds)
        return self._sample_all(together)

    def _decode_chunk(self, seq: Sequence) -> list[tuple[int, Completion]]:
        """One llama_decode of ``seq``'s next prompt chunk, its cells kept; after its last, it and the prompts equal
        to it sample their first token."""
        if seq.images and (imaged := media.prefill(self._context, self._keeping, seq)):  # an image, decoded whole
            self._computed += imaged
            return []
        batch, n = self._context.batch, next_chunk(seq)
        batch.n = 0
        last_row = batch.add_run(seq.prompt[seq.n_past:seq.n_past + n], seq.n_past, seq.slot)
        if seq.score_prompt:
            batch.logits[:n] = 1
        seq.n_past += n
        self._computed += n
        finishing = seq.n_past == len(seq.prompt)
        if finishing:  # the last prompt token: its logits give the first new token
            self._scheduler.prefilled([seq])
            batch.logits[last_row] = 1
            seq.output_row = last_row
        self._context.decode()
        if seq.score_prompt:
            score_prompt(seq.logprobs, self._context.logits, seq.prompt, seq.n_past - n, n, self._context.piece_bytes)
        self._keeping.save_computed(seq, n)
        if not finishing:
            return []
        twins = self._cells.share(seq, self._scheduler.twins(seq))
        self._scheduler.prefilled(twins)
        return self._sample_all([seq, *twins])

    def _propose(self, decoding: list[Sequence]) -> None:
        """This step's drafts of the sequences that speculate, in slot order, while the decode has rows
        for them (at most ``exact_rows`` in all, so every row gets the logits it gets alone; with ``exact: false``
        as many as the batch holds): looked up in the sequence's tokens, or sized here and made by the draft
        model, for all of them at once."""
        rows = len(decoding)
        if self._speculative is None:
            return
        max_rows = self._exact_rows if self._speculative.exact else len(self._context.batch.token)
        draft, wanted = self._draft, list[tuple[Sequence, int]]()
        draft_s = draft.draft_s(self._row_costs.expected(1)) if draft is not None else 0.0
        for seq in decoding:
            if seq.drafter is not None and not seq.replay and rows < max_rows:
                room = min(max_rows - rows, seq.max_tokens - len(seq.generated) - 1)
                if draft is None:
                    seq.drafts = seq.drafter.propose(seq.prompt, seq.generated, room, rows, self._row_costs)
                    rows += len(seq.drafts)
                elif k := seq.drafter.size(room, rows, self._row_costs, draft_s):
                    wanted.append((seq, k))
                    rows += k
        if draft is not None and wanted:
            made = draft.propose([Want(seq.slot, seq.prompt + seq.generated, len(seq.prompt), k, seq.salt)
                                  for seq, k in wanted])
            for (seq, _), drafts in zip(wanted, made, strict=True):
                seq.drafts = drafts

    def _sample_all(self, rows: list[Sequence]) -> list[tuple[int, Completion]]:
        """Sample every sequence of ``rows`` from the decode just made; the ones that ended."""
        done = []
        for seq in rows:
            ended = self._verify(seq) if seq.drafts else self._sample(seq)
            if ended is not None:
                done.append(self._finish(seq, ended))
        return done

    def _verify(self, seq: Sequence) -> str | None:
        """Sample ``seq`` from its next token's row and, while the token drawn is its next draft, from that
        draft's row; the cells of the drafts not taken are removed. The finish reason if it ended."""
        first, drafts = seq.output_row, seq.drafts

        def sample(row: int) -> tuple[int, str | None]:
            seq.output_row = first + row
            ended = self._sample(seq)
            return (seq.next_token if ended is None else -1), ended

        verified = verify(drafts, sample)
        seq.n_past += verified.taken
        if verified.taken < len(drafts):
            self._context.seq_rm(seq.slot, seq.n_past, -1)
        assert seq.drafter is not None  # only a drafter drafts
        seq.drafter.record(len(drafts), verified.taken)
        self._drafted += len(drafts)
        self._accepted += verified.taken
        seq.drafts = []
        return verified.ended

    def _sample(self, seq: Sequence) -> str | None:
        """Sample ``seq``'s next token and hand its text out; the finish reason if it ended."""
        if seq.replay:
            return replay.take(seq, self._context)
        if (token := seq.sampler.sample(self._context.ctx, seq.output_row)) < 0:
            return "error"  # its grammar's step ran past the budget: ``seq.sampler.refused`` says so
        if not seq.first_token_at:
            seq.first_token_at = time.perf_counter()
        piece, end_of_generation = self._context.piece(token)
        if end_of_generation:  # not part of the completion, as in create_completion
            seq.eog = token
            tail = seq.text.flush()
            if tail:
                seq.pieces.append(tail)
                seq.on_token(tail, len(seq.generated))
            return "stop"
        seq.generated.append(token)
        self._generated += 1
        if seq.logprobs is not None:
            seq.logprobs.add(self._context.logits(seq.output_row), token, self._context.piece_bytes)
        text, stopped = seq.text.push(piece)
        finished = "stop" if stopped else "length" if len(seq.generated) >= seq.max_tokens else None
        if finished == "length":
            text += seq.text.flush()
        if text:
            seq.pieces.append(text)
        go_on = seq.on_token(text, len(seq.generated))
        if finished is None:
            if not go_on:
                return "cancelled"
            seq.phase, seq.next_token = Phase.DECODE, token
        return finished

    def _finish(self, seq: Sequence, reason: str) -> tuple[int, Completion]:
        """Take ``seq`` out of the batch. Its KV cells stay: the slot's next prompt may start the same."""
        ended = time.perf_counter()
        seq.sampler.close()
        self._scheduler.remove(seq)
        self._cells.finished(seq)
        self._live.forget(seq)
        first = seq.first_token_at or ended
        return seq.slot, Completion(
            text="".join(seq.pieces), finish_reason=reason, prompt_tokens=len(seq.prompt),
            completion_tokens=len(seq.generated), prompt_s=first - seq.admitted_at, generate_s=ended - first,
            reused_tokens=seq.reused, logprobs=seq.logprobs.take() if seq.logprobs is not None else None,
            draft_tokens=seq.drafter.proposed if seq.drafter is not None else 0, error=seq.sampler.refused,
            accepted_tokens=seq.drafter.accepted if seq.drafter is not None else 0,
            reasoning_tokens=seq.sampler.spent if isinstance(seq.sampler, Phases) else 0)

    # --- the vocabulary ------------------------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        return self._context.tokenize(text, add_special)

    def token_bytes(self, token: int) -> bytes:
        self._context.in_vocabulary([token], "tokens")
        return self._context.text_bytes(token)

    # --- lifetime -----------------------------------------------------------------------------------

    def stats(self) -> BatchStats:
        cells = self._cells
        return BatchStats(self._steps, self._step_s, self._context.decode_s, self._computed, cells.reused,
                          self._generated, cells.copies, self._keeping.restored, self._drafted, self._accepted,
                          self._live.restored)

    def keep_running(self) -> None:
        self._live.save(self._scheduler.running.values(), leaving=True)

    def close(self) -> None:
        """Free every sampler, the context and the model. Running sequences are dropped unanswered. What the slots
        hold goes to the host store first (``Keeping.close``), so that it outlives the instance."""
        for seq in self._scheduler.running.values():
            seq.sampler.close()
        self._parking.close()
        self._scheduler.clear()
        self._grammars.close()
        self._keeping.close()
        if self._draft is not None:
            self._draft.close()
            self._draft = None
        self._context.close()

