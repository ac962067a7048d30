"""Continuous batching: one llama.cpp context decoding several sequences in one batch.

A context that decodes K sequences in one ``llama_decode`` call reads the model's weights once for all
K of them, which is where a memory-bound decode spends its time; K sequences cost little more than one.
``BatchEngine`` is the compute core for that: it knows nothing of processes or sockets. A caller (the
worker) admits requests into free slots and calls ``step`` in a loop:

    admit(slot, prompt, params, on_token)   tokenize, reuse the slot's cached prefix, queue the rest
    step()                                   one llama_decode of one token for every decoding sequence
                                             (with the drafts it verifies, when the model speculates:
                                             mpserve.engine.speculation; drafts of a draft model come
                                             from its own context, mpserve.engine.draft, made just
                                             before), then one llama_decode per
                                             prompt chunk of admitted
                                             sequences, at most ``step_budget_tokens`` in total while
                                             others decode (a chunk is never cut: at least one);
                                             after each decode, sample each sequence that has logits,
                                             with its own sampler chain; text and stop strings per
                                             sequence; on_token per sampled token; returns what finished
    cancel(slot)                             the sequence ends at the start of the next step

Slots are llama.cpp sequence ids 0..parallel-1, and the context holds ``parallel * n_ctx`` KV cells. By
default every slot has a stream of ``n_ctx`` cells of its own (llama-server's layout with ``--parallel``):
a token attends over its own sequence's cells only. ``kv_unified=True`` puts all cells in one pool
instead: a token's attention then spans the cells of every sequence (masked), which costs more with long
contexts, while a step with short ones is a little faster (bench/batch_bench.py measures both). Either
way a slot holds at most ``n_ctx`` cells, so a sequence never runs out of cells because of another, and
a slot keeps the cells of its last request after it finishes: a new prompt in that slot that starts
with the same tokens skips recomputing them (``best_slot`` finds the free slot with the longest such
prefix; the completion reports it as ``reused_tokens``); admitting a prompt cuts the slot's cells after
the shared prefix. When another slot, running or not, holds a longer shared prefix, its cells are copied
instead: a system prompt common to many requests is computed once per instance, not once per slot. Prompts
equal to one being computed (the n choices of one request) wait for it and take all of its cells and its
last row's logits (``_twins``): the whole prompt is computed once.

Beyond the slots, the host store (``mpserve.engine.host_store``: shared by every compatible instance on the
host, in RAM, with a disk tier under it): a prompt's whole chunks are saved there as soon as they are computed
(so they outlive this instance; on a model whose saved states cannot be cut back, a sliding-window or recurrent
one, also past PROMPT_CHUNK times each power of two, ``_reaches_checkpoint``, and with ``reuse: any`` at TAIL_MARKS
before its end), and before admission cuts a slot's cells the cells it would lose are saved (all, generated
tokens included; with ``reuse: exact``, the whole chunks), unless another slot or the store holds them, and so
is what every slot holds when the engine closes;
a prompt whose prefix the store holds more of than any slot (with ``reuse: exact``, in whole chunks) gets it
restored into its slot instead of computed (reported as reused, like cells a slot kept). An entry saved
from a text prompt carries the block hashes of the text its tokens spell; ``take_cache_changes`` hands the
entries added and dropped since the last call to the worker, which tells the broker (its routing sends a
prompt to the instance holding its prefix).

What a prompt may start from is the ``reuse`` mode. ``any`` (the default, llama-server's behaviour): the
longest prefix any cells hold, at any length, generated tokens included: after a reply a slot's cells hold
the prompt and the reply (all but the last token sampled), and a cache entry saved from them keeps them all,
so the next turn of a chat computes only what is new. ``exact``: whole prompt chunks only, so that output
equals a fresh computation. Prompts are computed in chunks of PROMPT_CHUNK tokens from position 0, each chunk
in a llama_decode of its own: the decodes ``llama_cpp.Llama`` makes for the same prompt. llama.cpp's CPU
kernels give a token slightly different numbers depending on how many tokens its batch holds (with quantized
weights, enough to change a greedy choice), so a prompt's tail computed after reused cells would not give
what the whole prompt computed at once gives. With ``exact`` only whole chunks are reused, copied or restored,
so the tokens computed after them are computed in the very chunks a fresh computation uses (a shared prefix
shorter than a chunk is computed again), and a sequence with a long context decodes in a llama_decode of its
own (``_decodes``). Either way the last prompt token is computed (its logits pick the first token), and cells
that the memory no longer holds are never reused: the prompt restores the host store's longest entry that is
all prefix of it instead (else is computed from the start), and the log says so once per model. A slot's own
cells are all held (a context's sliding-window layers keep every cell: llama.cpp's full-size SWA cache, its
default outside its server), and so are a restored state's when the prompt extends all
of its tokens; but a saved state holds on its sliding-window layers only the cells its next token attends to,
and a recurrent state only its last position, so such states are restored only whole (the host store's
``cut_back``), from the longest entry that is all prefix of the prompt: a checkpoint, a whole chunk, a
conversation's cells.

A request asking for its prompt's log-probabilities (``prompt_logprobs``, for echo) needs a logits row for
every prompt token: its prefill chunks (of SCORED_CHUNK tokens, which bounds the logits buffer) request
logits on all their rows, scored after the decode (``_score_prompt``); it never starts from cached cells,
its own or copied (their rows are gone), and its cells are never reused.

With ``reuse: exact``, greedy output equals ``llama_cpp.Llama.create_completion(prompt, temperature=0)`` with
the same flash attention setting: the same tokens (BOS, then the prompt tokenized without specials added and with
special tokens parsed), the same context settings, the same prompt decodes, the same sampler chain
(``mpserve.engine.sampling``). Decoding K sequences in one batch relies on a row's logits not depending on the
other rows, which holds for the small batches of one token per sequence that llama.cpp's kernels treat
like one row, and for the one-token rows of sequences with short contexts (docs/how-it-works/exact-output.md).
Not thread-safe:
one thread admits, cancels and steps; an on_token callback may call ``cancel`` but not ``admit``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import random
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np

from mpserve.config.kv_types import DEFAULT_KV_TYPE, KV_TYPES
from mpserve.config.speculative import Speculative
from mpserve.errors import BadRequest, Busy
from mpserve.models.builtin import cache_dir
from mpserve.structured import grammar_source
from mpserve.wire import protocol as wire
from mpserve.wire.prefix import block_hashes, common_prefix
from mpserve.wire.protocol import GenerateParams

from . import host_store, slot_file, vocab
from .draft import DraftModel, Want
from .grammar import GrammarCache
from .host_store import HostStore
from .interface import Completion, OnToken
from .llama_batch import Batch
from .logprobs import LogprobsRecorder
from .model_info import free, load_model, read_chat_template
from .prompt_cache import NO_CACHE, CacheStats, Changes, read_state, write_state
from .sampling import SamplerChain, TextStream
from .speculation import MAX_ROWS, Drafter, RowCosts, verify

log = logging.getLogger("mpserve.worker")

FLASH_ATTN_TYPES = {"auto": "LLAMA_FLASH_ATTN_TYPE_AUTO", "on": "LLAMA_FLASH_ATTN_TYPE_ENABLED",
                    "off": "LLAMA_FLASH_ATTN_TYPE_DISABLED"}
"""``flash_attn`` settings and llama.cpp's names for them; auto: llama.cpp turns it on where the device
supports it (always on a CPU), as llama-server does by default."""

PROMPT_CHUNK = 512
"""Prompt tokens per llama_decode, from position 0: llama_cpp.Llama's batch size (n_batch), so a prompt
is computed in the decodes create_completion makes. Also the prompt tokens per step while no sequence is
decoding, and with ``reuse: exact`` the unit of reuse: cells are reused or copied in whole chunks only."""

SCORED_CHUNK = 64
"""Prompt tokens per llama_decode for a prompt whose every row is scored (``prompt_logprobs``). Each row's
logits take a vocabulary's worth of floats, and llama.cpp keeps the largest output buffer a context ever
needed until the context is freed: scored in whole prompt chunks, one echo request on a model with a large
vocabulary would leave the instance holding far more memory than its KV cells. These cells are not computed
in prompt chunks, so with ``reuse: exact`` they are never reused, copied or kept in the prompt cache
(``_whole_cells``)."""

REUSE_MODES = ("any", "exact")
"""What a prompt may start from: ``any`` computed cells holding a prefix of it, of any length; ``exact`` whole
prompt chunks of them only, so that output equals a fresh computation."""

TAIL_TOKENS = 4
"""With ``reuse: any``, on a model whose saved states cannot be cut back, a prompt's cells are saved when all but its
last TAIL_TOKENS are computed (its last decode split there: one more decode, of TAIL_TOKENS), as llama-server
checkpoints 4 tokens before a prompt's end: a later prompt that repeats it with another short ending (a question
asked again, a reply regenerated) restores nearly all of it, where the entries of whole chunks and checkpoints
would leave up to a chunk to compute."""

ENDING_TOKENS = 64
"""... and when all but its last ENDING_TOKENS + TAIL_TOKENS are: the same long prompt (a document, a conversation)
with another question or instruction at its end, of up to ENDING_TOKENS tokens, restores all but that many more.
llama-server's other checkpoint near a prompt's end is a batch (512 tokens) before it, which leaves such a prompt
up to a chunk to compute."""

TAIL_MARKS = (ENDING_TOKENS + TAIL_TOKENS, TAIL_TOKENS)
"""Where a prompt's cells are saved before its end (tokens before it), nearest the start first. Only where the
prompt computed at least a chunk (PROMPT_CHUNK) since the cells it started from: a mark splits a decode, and a
small decode costs far more per token than a big one, so its first token waits longer (a chat's turn, which starts
from the conversation so far, or a shared preamble with its own question); a later prompt that repeats a short
computation would start where this one did and compute less than a chunk again."""

LONE_KV_CELLS = 256
"""The most cells a sequence holds and still decodes in a batch with others under ``reuse: exact``: llama.cpp pads
the cells an attention reads to a multiple of 256, and its CPU flash attention gives a lone query over 512 or more
of them a kernel of its own (``_decodes``)."""


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
    prompt_tokens_restored: int  # of those reused: restored from the host-RAM prompt cache
    draft_tokens: int = 0  # proposed by speculation and verified
    accepted_tokens: int = 0  # of those, the ones the sequences kept


class Phase(Enum):
    """A sequence's phase in its slot (llama.cpp's server calls these slot states):

        admit ──▶ PREFILL ──last prompt chunk decoded, first token sampled──▶ DECODE ──┐
                  (PROMPT_CHUNK tokens a decode, or whole                  ▲           │ one token a step
                   chunks of cells copied from another slot)               └───────────┘
        either ──stop / length / cancelled──▶ finished: out of the batch, its KV cells stay for reuse
    """

    PREFILL = "prefill"
    DECODE = "decode"


class _Sequence:
    """One admitted request in its slot."""

    __slots__ = ("slot", "prompt", "n_past", "reused", "max_tokens", "sampler", "text", "on_token", "generated",
                 "phase", "next_token", "output_row", "pieces", "admitted_at", "first_token_at", "cancel_requested",
                 "logprobs", "carried", "replay", "eog", "score_prompt", "drafter", "drafts", "marks")

    def __init__(self, slot: int, prompt: list[int], reused: int, max_tokens: int, sampler: SamplerChain,
                 text: TextStream, on_token: OnToken) -> None:
        self.slot = slot
        self.prompt = prompt
        self.n_past = reused  # tokens of this sequence that have KV cells: prompt, then generated
        self.reused = reused
        self.max_tokens = max_tokens
        self.sampler = sampler
        self.text = text
        self.on_token = on_token
        self.generated: list[int] = []
        self.phase = Phase.PREFILL
        self.next_token = -1  # DECODE: the last sampled token, to be decoded next step
        self.logprobs: LogprobsRecorder | None = None
        self.output_row = -1  # the batch row whose logits this sequence samples from after this decode
        self.pieces: list[str] = []  # text handed to on_token
        self.admitted_at = time.perf_counter()
        self.first_token_at = 0.0
        self.cancel_requested = False
        self.carried = 0  # the first tokens of ``generated``: generated by an instance that was lost
        self.replay: deque[int] = deque()  # those still to decode, one a step, in place of sampling
        self.eog = -1  # the end-of-generation token that ended it, if one did (reported by ``tokens``)
        self.score_prompt = False  # prompt_logprobs: every prompt token's row is scored, nothing is reused
        self.drafter: Drafter | None = None  # its model speculates
        self.drafts: list[int] = []  # this step's drafts, in the rows after ``output_row``
        self.marks: tuple[int, ...] = ()  # cells where its prefill decodes are split and its cells saved (TAIL_MARKS)


def _by_slot(seq: _Sequence) -> int:
    return seq.slot


def _whole_chunks(n: int) -> int:
    """``n`` cut down to whole prompt chunks."""
    return n - n % PROMPT_CHUNK


def _whole_cells(seq: _Sequence) -> int:
    """The leading cells of ``seq`` computed as whole prompt chunks (none for a scored prompt)."""
    return 0 if seq.score_prompt else _whole_chunks(min(seq.n_past, len(seq.prompt)))


def _reaches_checkpoint(start: int, end: int) -> bool:
    """Whether a chunk that computed cells ``start`` to ``end`` reached a checkpoint: PROMPT_CHUNK times a power of
    two. Where saved states cannot be cut back, a prompt's cells are saved after each such chunk, so that a later
    prompt sharing part of a long one restores about half of what it shares or more, while a prompt's entries take
    a few times a state's windowed cells and about twice its longest entry's other cells."""
    mark = PROMPT_CHUNK
    while mark <= start:
        mark *= 2
    return mark <= end


def _next_chunk(seq: _Sequence) -> int:
    """The prompt tokens ``seq`` computes in its next prefill decode: a chunk, ended early at its next mark, where its
    cells are saved (``_Sequence.marks``)."""
    n = min(SCORED_CHUNK if seq.score_prompt else PROMPT_CHUNK, len(seq.prompt) - seq.n_past)
    return next((mark - seq.n_past for mark in seq.marks if seq.n_past < mark < seq.n_past + n), n)


class BatchEngine:
    def __init__(self, path: str, n_ctx: int, parallel: int, threads: int, n_gpu_layers: int, seed: int = 0,
                 step_budget_tokens: int = 64, *, kv_unified: bool = False, flash_attn: str = "auto",
                 repack: bool = True, speculative: Speculative | None = None, cache_type_k: str = DEFAULT_KV_TYPE,
                 cache_type_v: str = DEFAULT_KV_TYPE, cache_ram: int = 0, cache_shm: str | None = None,
                 cache_disk: str | None = None, cache_disk_size: int = 0, reuse: str = "any", model: Any = None,
                 chat_template: str | None = None) -> None:
        """``model``: the llama.cpp model of ``path``, loaded already (by the zygote this process was forked
        from, ``mpserve.worker.zygote``), used instead of loading the file; the engine owns it from then on.
        ``cache_ram`` bytes in ``cache_shm`` and ``cache_disk_size`` bytes in ``cache_disk``: the host store's
        tiers (``mpserve.engine.host_store``; no store without a RAM tier). ``reuse``: ``any`` starts a prompt
        from the longest prefix of it that computed cells hold, ``exact`` from whole prompt chunks only (module
        docstring). ``chat_template``: the template it reports instead of the GGUF's (``read_chat_template``)."""
        import llama_cpp

        if not 1 <= parallel <= llama_cpp.llama_max_parallel_sequences():
            raise ValueError(f"parallel must be 1..{llama_cpp.llama_max_parallel_sequences()}, got {parallel}")
        if flash_attn not in FLASH_ATTN_TYPES:
            raise ValueError(f"flash_attn must be one of {', '.join(FLASH_ATTN_TYPES)}, got {flash_attn!r}")
        if cache_type_k not in KV_TYPES or cache_type_v not in KV_TYPES:
            raise ValueError(f"cache types must be among {', '.join(KV_TYPES)}, got {cache_type_k!r}, {cache_type_v!r}")
        if reuse not in REUSE_MODES:
            raise ValueError(f"reuse must be one of {', '.join(REUSE_MODES)}, got {reuse!r}")
        if step_budget_tokens < 1 or n_ctx < 2:
            raise ValueError("step_budget_tokens must be >= 1 and n_ctx >= 2")
        self._lib = llama_cpp
        self.n_ctx = n_ctx
        self.parallel = parallel
        self._budget = step_budget_tokens
        self._idle_budget = max(step_budget_tokens, PROMPT_CHUNK)
        self._rng = random.Random(seed)
        self._pieces: dict[int, tuple[bytes, bool]] = {}  # token -> (text bytes, end of generation)
        self._eog: list[int] | None = None
        self._tokenized: tuple[str, list[int]] = ("", [])
        self._cached: list[list[int]] = [[] for _ in range(parallel)]  # tokens with KV cells, per slot
        self._texts = [""] * parallel  # the text prompt those tokens begin with ("": token ids, or unknown)
        self._whole = [0] * parallel  # of those, the leading ones computed (or copied) as whole prompt chunks
        self._last_used = [0] * parallel
        self._uses = 0
        self._running: dict[int, _Sequence] = {}
        self._prefilling: deque[_Sequence] = deque()  # admission order
        self._steps = 0
        self._step_s = self._decode_s = 0.0
        self._computed = self._reused = self._generated = self._copies = self._restored = 0
        self._kv_unified = kv_unified
        self._exact = reuse == "exact"
        self._prompt_cache: HostStore | None = None
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # what Llama(verbose=False) does
        llama_cpp.llama_backend_init()

        self._model: Any = model if model is not None else load_model(llama_cpp, path, n_gpu_layers, repack)
        self._ctx: Any = None
        self._draft: DraftModel | None = None  # speculative type draft
        try:
            self._vocab = llama_cpp.llama_model_get_vocab(self._model)
            self._n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)
            self._grammars = GrammarCache(self._vocab)
            bos = llama_cpp.llama_vocab_bos(self._vocab)
            self._bos = [bos] if llama_cpp.llama_vocab_get_add_bos(self._vocab) and bos >= 0 else []
            capacity = max(PROMPT_CHUNK, parallel)  # most tokens one decode holds
            params = self._context_params(capacity, threads, kv_unified, flash_attn)
            params.type_k, params.type_v = KV_TYPES[cache_type_k].ggml_type, KV_TYPES[cache_type_v].ggml_type
            self._ctx = llama_cpp.llama_init_from_model(self._model, params)
            if not self._ctx:
                raise ValueError(f"cannot create a llama.cpp context (cache types {cache_type_k}/{cache_type_v}, "
                                 f"flash attention {flash_attn}; the log has llama.cpp's reason)")
        except BaseException:
            self.close()
            raise
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        n_swa = llama_cpp.llama_model_n_swa(self._model)
        recurrent = llama_cpp.llama_model_is_recurrent(self._model) or llama_cpp.llama_model_is_hybrid(self._model)
        self._n_swa = max(1, n_swa)  # llama-server's bound for what must stay
        self._cut_back = not (n_swa > 0 or recurrent)  # whether a restored state may be cut back
        self._told_cells_missing = False
        self._speculative = speculative
        if speculative is not None and recurrent:
            log.warning("speculative decoding is off: this model's recurrent state cannot drop rejected drafts")
            self._speculative = None
        self._row_costs = RowCosts()
        self._drafted = self._accepted = 0
        if self._speculative is not None and self._speculative.model is not None:
            try:
                self._draft = DraftModel(llama_cpp, self._speculative.model, path, self._model,
                                         self._context_params(PROMPT_CHUNK, threads, False, flash_attn),
                                         n_gpu_layers, repack, PROMPT_CHUNK)
            except BaseException:
                self.close()
                raise
        self._identity = self._slot_identity(cache_type_k, cache_type_v)
        if cache_ram and cache_shm:
            try:
                self._prompt_cache = self._open_store(path, Path(cache_shm), cache_ram, cache_disk, cache_disk_size,
                                                      flash_attn, repack, n_gpu_layers)
            except BaseException:
                self.close()
                raise
        self._batch = Batch(llama_cpp, capacity)
        self.chat = read_chat_template(llama_cpp, self._model, chat_template)
        self._warm_up()

    def _slot_identity(self, cache_type_k: str, cache_type_v: str) -> slot_file.Identity:
        """What a slot file saved here must match to be restored here."""
        lib, description = self._lib, ctypes.create_string_buffer(256)
        lib.llama_model_desc(self._model, description, 256)
        return slot_file.Identity(description.value.decode(errors="replace"), lib.llama_model_n_params(self._model),
                                  lib.llama_model_size(self._model), cache_type_k, cache_type_v,
                                  1 if self._kv_unified else self.parallel)

    def _context_params(self, capacity: int, threads: int, kv_unified: bool, flash_attn: str) -> Any:
        """The context ``llama_cpp.Llama`` would create with the same flash attention setting (same RoPE
        settings), with ``parallel`` sequences of ``n_ctx`` cells each: a stream of its own each, or one
        shared pool."""
        lib = self._lib
        params = lib.llama_context_default_params()
        params.n_ctx = self.n_ctx * self.parallel
        params.n_seq_max = self.parallel
        params.kv_unified = kv_unified
        params.n_batch = capacity
        params.n_ubatch = capacity
        params.n_threads = params.n_threads_batch = threads
        params.flash_attn_type = getattr(lib, FLASH_ATTN_TYPES[flash_attn])
        params.yarn_ext_factor = -1.0
        params.yarn_attn_factor = 1.0
        params.yarn_beta_fast = 32.0
        params.yarn_beta_slow = 1.0
        params.no_perf = True
        return params

    def _warm_up(self) -> None:
        """llama.cpp sets up its compute graphs and thread pool on the first decode; do it while loading,
        so the first request does not pay for it."""
        self._batch.n = 0
        self._batch.add(self._bos[0] if self._bos else 0, 0, 0)
        if self._lib.llama_decode(self._ctx, self._batch.view()) != 0:
            raise RuntimeError("llama_decode failed while warming up")
        self._lib.llama_memory_seq_rm(self._memory, 0, -1, -1)
        self._batch.n = 0

    # --- slots --------------------------------------------------------------------------------------

    @property
    def active(self) -> int:
        return len(self._running)

    def free_slots(self) -> list[int]:
        return [slot for slot in range(self.parallel) if slot not in self._running]

    def kv_cells(self, slot: int) -> int:
        """The KV cells ``slot`` holds now: its running sequence's, or what its last request left."""
        seq = self._running.get(slot)
        return seq.n_past if seq is not None else len(self._cached[slot])

    def best_slot(self, prompt: str) -> tuple[int, int]:
        """The free slot whose cached tokens share the longest prefix with ``prompt``, and how many
        prompt tokens ``admit`` would reuse there. Ties go to the least recently used slot, so a
        prompt with nothing to reuse does not evict another prompt's prefix when it need not."""
        free = self.free_slots()
        if not free:
            raise Busy("no free slot")
        tokens = self._tokenize(prompt)
        return max(((slot, self._reusable(slot, tokens)) for slot in free),
                   key=lambda sr: (sr[1], -self._last_used[sr[0]]))

    def _reusable(self, slot: int, tokens: list[int]) -> int:
        """Prompt tokens ``slot``'s cells hold (with ``reuse: exact``, in whole chunks computed as prompt chunks);
        the last prompt token is always computed again (its logits pick the first new token)."""
        shared = min(common_prefix(self._kv_tokens(slot), tokens), len(tokens) - 1)
        return _whole_chunks(min(shared, self._whole_cells(slot))) if self._exact else shared

    def _usable(self, n: int) -> int:
        """Of ``n`` leading cells or prompt tokens, how many a prompt may start from: all with ``reuse: any``,
        whole prompt chunks with ``exact``."""
        return _whole_chunks(n) if self._exact else n

    def _whole_cells(self, slot: int) -> int:
        """The leading cells of ``slot`` that are whole prompt chunks (a running sequence's, or what its last
        request left); generated tokens' cells never are: they were decoded one token at a time."""
        seq = self._running.get(slot)
        return _whole_cells(seq) if seq is not None else self._whole[slot]

    def _holds_cells(self, slot: int, n: int) -> bool:
        """Whether ``slot``'s memory still has what a token at position ``n`` needs of its first ``n`` cells,
        as llama-server checks it: a sliding-window cache may have dropped cells its window has passed (at
        most ``n - n_swa`` of them), and a recurrent state holds only its last position."""
        if n == 0:
            return True
        pos_min = self._lib.llama_memory_seq_pos_min(self._memory, slot)
        if 0 <= pos_min <= max(0, n - self._n_swa):
            return True
        if not self._told_cells_missing:
            self._told_cells_missing = True
            instead = ("restores instead the host store's longest entry that is all prefix of it (a checkpoint "
                       "at a whole chunk) and computes the rest" if self._prompt_cache is not None else
                       "is computed from the start (no host store here: cache_ram 0)")
            log.info("this model's sliding-window (or recurrent) layers keep only the last cells of a restored "
                     "state, so a prompt sharing only part of a slot's restored cells cannot keep them: it %s "
                     "(said once)", instead)
        return False

    def _kv_tokens(self, slot: int) -> list[int]:
        """The tokens whose KV cells ``slot`` holds now: a running sequence's prompt and generated tokens
        decoded so far, else what its last request left."""
        seq = self._running.get(slot)
        return (seq.prompt + seq.generated)[:seq.n_past] if seq is not None else self._cached[slot]

    def _take_cells(self, slot: int, tokens: list[int]) -> int:
        """Cut ``slot``'s cells after the prefix of ``tokens`` they hold; returns its length. (A longer prefix
        in another slot is copied over by ``_catch_up`` before the next step.)"""
        own = self._reusable(slot, tokens)
        if not self._lib.llama_memory_seq_rm(self._memory, slot, own, -1) or not self._holds_cells(slot, own):
            self._lib.llama_memory_seq_rm(self._memory, slot, -1, -1)  # whole-sequence removal never fails
            return 0
        return own

    def _catch_up(self) -> None:
        """Before a step: a prompt still being computed takes over another slot's cells when they hold more
        of it (``_reusable``), whether they were there when it was admitted or were computed since (two
        requests with one system prompt, admitted together, compute it once)."""
        for seq in self._prefilling:
            if seq.score_prompt:
                continue
            source, shared = self._copy_source(seq.slot, seq.prompt)
            if shared > seq.n_past and self._holds_cells(source, shared):
                self._copy_prefix(source, seq.slot, shared)
                self._reused += shared - seq.n_past
                seq.reused += shared - seq.n_past
                seq.n_past = shared

    def _copy_source(self, slot: int, tokens: list[int]) -> tuple[int, int]:
        """The other slot whose cells hold the longest prefix of ``tokens`` that may be reused, and how many
        tokens of it."""
        return max(((other, self._reusable(other, tokens)) for other in range(self.parallel) if other != slot),
                   key=lambda found: found[1], default=(slot, 0))

    def _copy_prefix(self, source: int, slot: int, n: int) -> None:
        """Replace ``slot``'s cells with a copy of ``source``'s first ``n``."""
        lib, memory = self._lib, self._memory
        lib.llama_memory_seq_rm(memory, slot, -1, -1)
        if self._kv_unified:  # one pool: the cells get a second owner, nothing is copied
            lib.llama_memory_seq_cp(memory, source, slot, 0, n)
        else:  # llama.cpp copies whole streams only (at the next decode): copy, then cut after the prefix
            lib.llama_memory_seq_cp(memory, source, slot, -1, -1)
            lib.llama_memory_seq_rm(memory, slot, n, -1)
        self._copies += 1

    # --- the host store ----------------------------------------------------------------------------------

    def _open_store(self, path: str, ram_dir: Path, ram_bytes: int, disk_dir: str | None, disk_bytes: int,
                    flash_attn: str, repack: bool, n_gpu_layers: int) -> HostStore:
        """The host store's view for this instance: its compatibility key says what its states depend on."""
        lib = self._lib
        identity = {"format": host_store.FORMAT, "gguf_sha256": host_store.gguf_digest(path, cache_dir() / "digests"),
                    "model": self._identity.model, "type_k": self._identity.cache_type_k,
                    "type_v": self._identity.cache_type_v, "kv_streams": self._identity.kv_streams,
                    "flash_attn": flash_attn, "repack": repack, "n_gpu_layers": n_gpu_layers,
                    "llama_cpp": lib.__version__, "state_seq_version": lib.LLAMA_STATE_SEQ_VERSION,
                    # a state saved with reuse: any may hold cells computed after a prefix of any length, which
                    # exact must not start from: the two modes keep their entries apart
                    "reuse": "exact" if self._exact else "any"}
        return HostStore(host_store.compatibility_key(identity), identity, ram_dir, ram_bytes,
                         Path(disk_dir) if disk_dir else None, disk_bytes, self.n_ctx, self._cut_back)

    def _store_prompt(self, seq: _Sequence, computed: int) -> None:
        """After each prompt chunk of ``seq`` (``computed`` tokens): once its cells are the most of its prompt a later
        prompt can reuse (all but its last chunk; with ``reuse: exact``, its whole chunks short of its last token),
        save them into the host store (unless it holds them), so that they outlive this instance (a crash, an
        unload, a restart with a disk tier). Saved there, not at the prompt's end: a prompt that extends them
        restores them without a cut, which a state of a sliding-window model needs. Where saved states cannot be
        cut back, also after each chunk that reaches a checkpoint (``_reaches_checkpoint``), which a prompt sharing
        part of this one restores, and at its marks before its end (``_Sequence.marks``). Chunks run from the cells a
        prompt started from, so with ``reuse: any`` an entry may end anywhere."""
        store, left = self._prompt_cache, len(seq.prompt) - seq.n_past
        if store is None or seq.score_prompt or seq.n_past < PROMPT_CHUNK or left == 0 or not (
                left <= PROMPT_CHUNK or not self._cut_back and _reaches_checkpoint(seq.n_past - computed, seq.n_past)):
            return
        kept = seq.prompt[:seq.n_past]
        if store.holds(kept):
            return
        state, size = read_state(self._lib, self._ctx, seq.slot)
        if store.wants(size):
            store.put(kept, state, size, self._summary_of(kept, self._texts[seq.slot]))

    def _keep_in_cache(self, slot: int, tokens: list[int]) -> None:
        """Before admitting ``tokens`` cuts ``slot``'s cells: save the cells it would lose (all, generated tokens
        included; with ``reuse: exact``, the whole chunks) into the host store, unless another slot or the store
        holds them already. Fewer than a chunk's cells are not kept: one decode computes them again."""
        whole, store = (self._whole[slot] if self._exact else len(self._cached[slot])), self._prompt_cache
        if whole < PROMPT_CHUNK or self._reusable(slot, tokens) >= whole or store is None:
            return
        kept = self._cached[slot][:whole]
        if store.holds(kept) or self._copy_source(slot, kept + [-1])[1] >= whole:
            return
        if not self._lib.llama_memory_seq_rm(self._memory, slot, whole, -1) or not self._holds_cells(slot, whole):
            return  # only whole chunks are worth keeping, and this memory cannot be cut back to them
        state, size = read_state(self._lib, self._ctx, slot)
        if store.wants(size):
            store.put(kept, state, size, self._summary(slot, kept))

    def _summary(self, slot: int, kept: list[int]) -> tuple[int, ...]:
        """What the broker routes by, for a store entry of ``kept``, the first tokens of ``slot``'s cells."""
        return self._summary_of(kept, self._texts[slot])

    def _summary_of(self, kept: list[int], text: str) -> tuple[int, ...]:
        """The block hashes of the part of the text prompt ``text`` that ``kept`` spells (nothing for a prompt of
        token ids)."""
        if not text:
            return ()
        spelled = vocab.detokenize(self._lib, self._vocab, kept[len(self._bos):])
        return block_hashes(text[:common_prefix(spelled, text)])

    def _restore_from_cache(self, slot: int, tokens: list[int], reused: int) -> int:
        """The prompt tokens ``slot`` starts from: ``reused`` of its own cells, or more restored from the prompt
        cache when it holds more of ``tokens`` than any slot (with ``reuse: exact``, in whole chunks; a hit). A prompt
        with less than a chunk to reuse does not look (one decode computes it), as a slot's cells are not kept for
        less."""
        reusable, store = self._usable(len(tokens) - 1), self._prompt_cache
        if store is None or reusable < PROMPT_CHUNK:
            return reused
        held = max(reused, self._copy_source(slot, tokens)[1])
        if held >= reusable:
            return reused  # the slots hold all there is to reuse: no need to look
        entry, shared = store.find(tokens[:reusable])
        restorable = self._usable(shared)
        loaded = store.load(entry) if entry is not None and restorable > held else None
        if loaded is None:
            store.count(hit=False)
            return reused
        lib, memory = self._lib, self._memory
        lib.llama_memory_seq_rm(memory, slot, -1, -1)
        restored = write_state(lib, self._ctx, slot, *loaded)
        if not restored or not lib.llama_memory_seq_rm(memory, slot, restorable, -1) or not self._holds_cells(
                slot, restorable):
            lib.llama_memory_seq_rm(memory, slot, -1, -1)
            store.count(hit=False)
            return 0
        store.count(hit=True)
        self._restored += restorable
        return restorable

    def cache_stats(self) -> CacheStats:
        return self._prompt_cache.stats() if self._prompt_cache is not None else NO_CACHE

    def take_cache_changes(self) -> wire.CacheChanges:
        return _on_wire(self._prompt_cache.take_changes() if self._prompt_cache is not None else Changes())

    def cache_snapshot(self) -> wire.CacheChanges:
        if self._prompt_cache is None:
            return wire.CacheChanges()
        return _on_wire(self._prompt_cache.snapshot(wire.MAX_CACHE_ITEMS, wire.MAX_CACHE_HASHES))

    # --- slot files ----------------------------------------------------------------------------------

    def save_slot(self, slot: int, path: Path) -> int:
        """Write idle ``slot``'s cells and their tokens to ``path`` (``mpserve.engine.slot_file``); the tokens."""
        self._idle(slot)
        tokens = self._cached[slot]
        state, size = read_state(self._lib, self._ctx, slot)
        if not tokens or not size:
            raise BadRequest(f"slot {slot} holds no KV cells to save")
        slot_file.write(path, slot_file.SlotFile(self._identity, tokens, self._whole[slot], state, size))
        return len(tokens)

    def restore_slot(self, slot: int, path: Path) -> int:
        """Replace idle ``slot``'s cells with those saved in ``path``; the tokens restored. A file that does not
        match this instance is refused (BadRequest saying why) and the slot keeps its cells."""
        self._idle(slot)
        saved = slot_file.read(path, self._identity)
        if len(saved.tokens) >= self.n_ctx:
            raise BadRequest(f"slot file {path.name!r} holds {len(saved.tokens)} tokens; a slot here holds "
                             f"{self.n_ctx}")
        if not write_state(self._lib, self._ctx, slot, saved.state, saved.size):
            self.erase_slot(slot)
            raise BadRequest(f"llama.cpp refused the KV cells of slot file {path.name!r}; the slot is empty")
        self._cached[slot], self._whole[slot], self._texts[slot] = saved.tokens, saved.whole, ""
        return len(saved.tokens)

    def erase_slot(self, slot: int) -> int:
        """Drop idle ``slot``'s cells; how many it held."""
        self._idle(slot)
        held = len(self._cached[slot])
        self._lib.llama_memory_seq_rm(self._memory, slot, -1, -1)
        self._cached[slot], self._whole[slot], self._texts[slot] = [], 0, ""
        return held

    def _idle(self, slot: int) -> None:
        if not 0 <= slot < self.parallel:
            raise BadRequest(f"slot {slot} is not a slot of this instance (0..{self.parallel - 1})")
        if slot in self._running:
            raise BadRequest(f"slot {slot} is running a request; try again when it is idle")

    # --- requests -----------------------------------------------------------------------------------

    def admit(self, slot: int, prompt: str | list[int], params: GenerateParams, on_token: OnToken,
              carried: Sequence[int] = ()) -> None:
        """Start ``prompt`` in free slot ``slot``; its prompt is computed by the coming steps. A prompt of
        token ids is taken as it is (no BOS added), as create_completion takes one. ``carried``:
        the tokens another instance generated for this request before it was lost. They are decoded one a
        step after the prompt, as they were first computed, taken instead of sampled (so the sampler's
        penalties see them): a batched prefill orders attention's sums otherwise, which can turn a greedy
        choice at a near-tie. Their text opens the completion without reaching ``on_token`` (the client has
        it, and their log-probabilities), and what the text stream held back at the cut stays held back: the
        sequence continues as if never interrupted."""
        if not 0 <= slot < self.parallel or slot in self._running:
            raise ValueError(f"slot {slot} is not a free slot of 0..{self.parallel - 1}")
        tokens = self._tokenize(prompt) if isinstance(prompt, str) else self._in_vocabulary(prompt, "prompt")
        self._in_vocabulary([t for t, _ in params.logit_bias], "logit_bias")
        source = grammar_source(params.grammar, params.json_schema)
        grammar = self._grammars.sampler(source) if source is not None else None  # BadRequest if unparsable
        if not tokens:
            raise BadRequest("the prompt is empty and the model has no BOS token to start from")
        if len(tokens) >= self.n_ctx:
            raise BadRequest(f"the prompt is {len(tokens)} tokens; the context holds {self.n_ctx} per sequence")
        # prompt_logprobs needs every prompt row, which cached cells no longer have (a hand-over's client has
        # the prompt's already: carried tokens skip it)
        score_prompt = params.prompt_logprobs and params.logprobs is not None and not carried
        self._keep_in_cache(slot, tokens)
        if score_prompt:
            self._lib.llama_memory_seq_rm(self._memory, slot, -1, -1)
        reused = 0 if score_prompt else self._restore_from_cache(slot, tokens, self._take_cells(slot, tokens))
        self._cached[slot] = tokens[:reused]
        self._texts[slot] = prompt if isinstance(prompt, str) else ""
        self._whole[slot] = reused if self._exact else 0  # cells reused at any length are no fresh computation's
        self._uses += 1
        self._last_used[slot] = self._uses
        seed = params.seed if params.seed is not None else self._rng.randrange(2**32 - 1)
        max_tokens = min(params.max_tokens, self.n_ctx - len(tokens))
        if len(carried) > max_tokens:
            raise BadRequest(f"{len(carried)} tokens carried over, more than the {max_tokens} to generate")
        seq = _Sequence(
            slot, tokens, reused, max_tokens,
            SamplerChain(self._n_vocab, params, seed, self._eog_tokens() if params.ignore_eos else (), grammar),
            TextStream(params.stop, strip_leading_space=not prompt), on_token,
        )
        if params.logprobs is not None:
            seq.logprobs = LogprobsRecorder(params.logprobs)
            seq.score_prompt = score_prompt
            if score_prompt and tokens[0] not in self._bos:  # a first token nothing precedes (BOS is not echoed)
                seq.logprobs.add_unscored(tokens[0], self._piece_bytes)
        if self._speculative is not None and params.speculative_n_max != 0:
            n_max = min(self._speculative.n_max, params.speculative_n_max or self._speculative.n_max)
            seq.drafter = Drafter(dataclasses.replace(self._speculative, n_max=n_max,
                                                      n_min=min(n_max, self._speculative.n_min)))
        seq.carried, seq.replay = len(carried), deque(carried)
        if self._prompt_cache is not None and not self._exact and not self._cut_back and not score_prompt:
            seq.marks = tuple(mark for mark in (len(tokens) - before for before in TAIL_MARKS)
                              if mark >= reused + PROMPT_CHUNK)
        self._running[slot] = seq
        self._prefilling.append(seq)
        self._reused += reused

    def tokens(self, slot: int) -> Sequence[int]:
        """The tokens the sequence in ``slot`` sampled so far (not the carried ones), then the end-of-
        generation token if one ended it: carried over, it says that the text was all sent."""
        seq = self._running.get(slot)
        if seq is None:
            return ()
        return seq.generated[seq.carried:] + ([seq.eog] if seq.eog >= 0 else [])

    def cancel(self, slot: int) -> None:
        """End the sequence in ``slot`` at the start of the next step (finish_reason "cancelled").
        A slot with nothing running is left alone: the request may have just finished."""
        seq = self._running.get(slot)
        if seq is not None:
            seq.cancel_requested = True

    def take_logprobs(self, slot: int) -> wire.Logprobs | None:
        """The log-probabilities of the tokens ``slot``'s sequence generated since the last take."""
        seq = self._running.get(slot)
        return seq.logprobs.take() if seq is not None and seq.logprobs is not None else None

    def step(self) -> list[tuple[int, Completion]]:
        """One llama_decode for the decoding sequences, one per prompt chunk; returns the sequences that
        ended in them."""
        started = time.perf_counter()
        done = [self._finish(seq, "cancelled") for seq in list(self._running.values()) if seq.cancel_requested]
        if self.parallel > 1:
            self._catch_up()
        # Rows in slot order: with a KV stream per slot, llama.cpp splits a batch into micro-batches where
        # the sequence ids are out of order, and every micro-batch is one more pass over the weights.
        decoding = sorted((seq for seq in self._running.values() if seq.phase is Phase.DECODE), key=_by_slot)
        chunks = self._chunks(self._budget if decoding else self._idle_budget)
        batch = self._batch
        if decoding:
            self._propose(decoding)
        for together in self._decodes(decoding):
            batch.n = 0
            for seq in together:  # a sequence's next token, then its drafts (if any) at the positions after it
                seq.output_row = batch.add(seq.next_token, seq.n_past, seq.slot)
                for i, token in enumerate(seq.drafts, 1):
                    batch.add(token, seq.n_past + i, seq.slot)
                seq.n_past += 1
            rows, seconds = batch.n, self._decode()
            if self._speculative is not None:
                self._row_costs.observe(rows, seconds)
            done += self._sample_all(together)
        for seq in chunks:
            batch.n = 0
            n = _next_chunk(seq)
            last_row = batch.add_run(seq.prompt[seq.n_past:seq.n_past + n], seq.n_past, seq.slot)
            if seq.score_prompt:
                batch.logits[:n] = 1
            seq.n_past += n
            self._computed += n
            finishing = seq.n_past == len(seq.prompt)
            if finishing:  # the last prompt token: its logits give the first new token
                self._prefilling.remove(seq)
                batch.logits[last_row] = 1
                seq.output_row = last_row
            self._decode()
            if seq.score_prompt:
                self._score_prompt(seq, seq.n_past - n, n)
            self._store_prompt(seq, n)
            if finishing:
                done += self._sample_all([seq, *self._twins(seq)])
        self._steps += 1
        self._step_s += time.perf_counter() - started
        return done

    def _decodes(self, decoding: list[_Sequence]) -> list[list[_Sequence]]:
        """The decoding sequences grouped by llama_decode: all in one, except with ``reuse: exact`` and a KV
        stream per slot, where a sequence with more than LONE_KV_CELLS cells decodes alone. llama.cpp gives a
        lone query over that many cells its own attention kernel (the CPU's flash attention splits the cells
        among threads and sums the parts), and a batch of several streams another: decoded together, such a
        sequence gets other numbers than a fresh computation of it, enough to change a greedy choice."""
        if not self._exact or self._kv_unified or len(decoding) < 2:
            return [decoding] if decoding else []
        long = [[seq] for seq in decoding if seq.n_past + 1 > LONE_KV_CELLS]
        short = [seq for seq in decoding if seq.n_past + 1 <= LONE_KV_CELLS]
        return ([short] if short else []) + long

    def _chunks(self, budget: int) -> list[_Sequence]:
        """The prompts that compute their next chunk this step, in admission order, while ``budget`` prompt
        tokens last (the first chunk always: a chunk is never cut)."""
        chosen: list[_Sequence] = []
        for seq in self._prefilling:
            if chosen and budget < _next_chunk(seq):
                break
            if not seq.score_prompt and any(
                    lead.prompt == seq.prompt
                    or self._usable(min(common_prefix(lead.prompt, seq.prompt), len(seq.prompt) - 1)) > seq.n_past
                    for lead in chosen):
                continue  # an earlier prompt is computing this one's next tokens: copy them when it is done
            chosen.append(seq)
            budget -= _next_chunk(seq)
        return chosen

    def _twins(self, lead: _Sequence) -> list[_Sequence]:
        """The prompts waiting that equal ``lead``'s, whose last chunk was just decoded (the choices of a
        request for n): they take all its cells and sample from its last row, so the prompt is computed once
        and each first token comes from the logits a computation of its own would give."""
        twins = [seq for seq in self._prefilling if seq.prompt == lead.prompt and not seq.score_prompt]
        if not twins or not self._holds_cells(lead.slot, len(lead.prompt)):
            return []
        for seq in twins:
            self._copy_prefix(lead.slot, seq.slot, len(lead.prompt))
            self._reused += len(seq.prompt) - seq.n_past
            seq.reused += len(seq.prompt) - seq.n_past
            seq.n_past, seq.output_row = len(seq.prompt), lead.output_row
            self._prefilling.remove(seq)
        return twins

    def _propose(self, decoding: list[_Sequence]) -> None:
        """This step's drafts of the sequences that speculate, in slot order, while the decode has rows
        for them (at most MAX_ROWS in all, so every row gets the logits it gets alone; with ``exact: false``
        as many as the batch holds): looked up in the sequence's tokens, or sized here and made by the draft
        model, for all of them at once."""
        rows = len(decoding)
        if self._speculative is None:
            return
        max_rows = MAX_ROWS if self._speculative.exact else len(self._batch.token)
        draft, wanted = self._draft, list[tuple[_Sequence, int]]()
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
            made = draft.propose([Want(seq.slot, seq.prompt + seq.generated, len(seq.prompt), k) for seq, k in wanted])
            for (seq, _), drafts in zip(wanted, made, strict=True):
                seq.drafts = drafts

    def _sample_all(self, rows: list[_Sequence]) -> list[tuple[int, Completion]]:
        """Sample every sequence of ``rows`` from the decode just made; the ones that ended."""
        done = []
        for seq in rows:
            ended = self._verify(seq) if seq.drafts else self._sample(seq)
            if ended is not None:
                done.append(self._finish(seq, ended))
        return done

    def _decode(self) -> float:
        """llama_decode of the batch; the seconds it took. It always finds KV cells: a slot holds at most
        n_ctx of them, running or cached, and the context has n_ctx per slot (in a stream of its own, or in
        the shared pool, where llama.cpp takes free cells wherever they are)."""
        decode_started = time.perf_counter()
        rc = self._lib.llama_decode(self._ctx, self._batch.view())
        seconds = time.perf_counter() - decode_started
        self._decode_s += seconds
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with status {rc}")
        return seconds

    def _verify(self, seq: _Sequence) -> str | None:
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
            self._lib.llama_memory_seq_rm(self._memory, seq.slot, seq.n_past, -1)
        assert seq.drafter is not None  # only a drafter drafts
        seq.drafter.record(len(drafts), verified.taken)
        self._drafted += len(drafts)
        self._accepted += verified.taken
        seq.drafts = []
        return verified.ended

    def _score_prompt(self, seq: _Sequence, pos: int, n: int) -> None:
        """Record the log-probability of each prompt token that follows a row of the chunk just decoded (its
        ``n`` tokens from position ``pos``; the last prompt token's row scores the first sampled token, in
        ``_sample``)."""
        assert seq.logprobs is not None
        for i in range(min(n, len(seq.prompt) - 1 - pos)):
            row = self._lib.llama_get_logits_ith(self._ctx, i)
            seq.logprobs.add(np.ctypeslib.as_array(row, (self._n_vocab,)), seq.prompt[pos + i + 1], self._piece_bytes,
                             prompt=True)

    def _sample(self, seq: _Sequence) -> str | None:
        """Sample ``seq``'s next token and hand its text out; the finish reason if it ended."""
        if seq.replay:
            return self._replay(seq)
        token = seq.sampler.sample(self._ctx, seq.output_row)
        if not seq.first_token_at:
            seq.first_token_at = time.perf_counter()
        piece, end_of_generation = self._piece(token)
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
            row = self._lib.llama_get_logits_ith(self._ctx, seq.output_row)
            seq.logprobs.add(np.ctypeslib.as_array(row, (self._n_vocab,)), token, self._piece_bytes)
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

    def _replay(self, seq: _Sequence) -> str | None:
        """Take the next carried token as if sampled; its text goes into the completion only. The finish
        reason if the lost instance had ended there (it died between its last text and its answer)."""
        token = seq.replay.popleft()
        piece, end_of_generation = self._piece(token)
        if end_of_generation:
            seq.pieces.append(seq.text.flush())
            return "stop"
        seq.sampler.accept([token])
        seq.generated.append(token)
        text, stopped = seq.text.push(piece)
        finished = "stop" if stopped else "length" if len(seq.generated) >= seq.max_tokens else None
        if finished == "length":
            text += seq.text.flush()
        seq.pieces.append(text)
        if finished is None:
            if not seq.on_token("", len(seq.generated)):  # progress for the watchdog; a cancel
                return "cancelled"
            seq.phase, seq.next_token = Phase.DECODE, token
        return finished

    def _finish(self, seq: _Sequence, reason: str) -> tuple[int, Completion]:
        """Take ``seq`` out of the batch. Its KV cells stay: the slot's next prompt may start the same."""
        ended = time.perf_counter()
        seq.sampler.close()
        del self._running[seq.slot]
        if seq in self._prefilling:
            self._prefilling.remove(seq)
        self._cached[seq.slot] = (seq.prompt + seq.generated)[:seq.n_past]
        self._whole[seq.slot] = _whole_cells(seq) if self._exact else 0
        first = seq.first_token_at or ended
        return seq.slot, Completion(
            text="".join(seq.pieces), finish_reason=reason, prompt_tokens=len(seq.prompt),
            completion_tokens=len(seq.generated), prompt_s=first - seq.admitted_at, generate_s=ended - first,
            reused_tokens=seq.reused, logprobs=seq.logprobs.take() if seq.logprobs is not None else None,
            draft_tokens=seq.drafter.proposed if seq.drafter is not None else 0,
            accepted_tokens=seq.drafter.accepted if seq.drafter is not None else 0,
        )

    # --- tokens -------------------------------------------------------------------------------------

    def _tokenize(self, prompt: str) -> list[int]:
        """BOS, then the prompt as create_completion tokenizes it (no specials added, specials parsed).
        The last result is kept: best_slot and admit usually tokenize the same prompt one after the other."""
        if self._tokenized[0] == prompt and self._tokenized[1]:
            return self._tokenized[1]
        tokens = self._bos + self._llama_tokenize(prompt, False)
        self._tokenized = (prompt, tokens)
        return tokens

    def _llama_tokenize(self, text: str, add_special: bool) -> list[int]:
        return vocab.tokenize(self._lib, self._vocab, text, add_special, True)

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        return self._llama_tokenize(text, add_special)

    def token_bytes(self, token: int) -> bytes:
        self._in_vocabulary([token], "tokens")
        return vocab.piece(self._lib, self._vocab, token)

    def _in_vocabulary(self, tokens: list[int], key: str) -> list[int]:
        outside = next((t for t in tokens if not 0 <= t < self._n_vocab), None)
        if outside is not None:
            raise BadRequest(f"'{key}' has token {outside}; the model's vocabulary has {self._n_vocab} tokens")
        return tokens

    def _eog_tokens(self) -> list[int]:
        """The vocabulary's end-of-generation tokens (what ``ignore_eos`` bans), found once."""
        if self._eog is None:
            is_eog = self._lib.llama_vocab_is_eog
            self._eog = [t for t in range(self._n_vocab) if is_eog(self._vocab, t)]
        return self._eog

    def _piece_bytes(self, token: int) -> bytes:
        return self._piece(token)[0]

    def _piece(self, token: int) -> tuple[bytes, bool]:
        known = self._pieces.get(token)
        if known is None:
            lib = self._lib
            buffer = ctypes.create_string_buffer(64)
            n = lib.llama_token_to_piece(self._vocab, token, buffer, 64, 0, False)
            if n < 0:
                buffer = ctypes.create_string_buffer(-n)
                n = lib.llama_token_to_piece(self._vocab, token, buffer, -n, 0, False)
            known = (buffer.raw[:n], bool(lib.llama_vocab_is_eog(self._vocab, token)))
            self._pieces[token] = known
        return known

    # --- lifetime -----------------------------------------------------------------------------------

    def stats(self) -> BatchStats:
        return BatchStats(self._steps, self._step_s, self._decode_s, self._computed, self._reused,
                          self._generated, self._copies, self._restored, self._drafted, self._accepted)

    def close(self) -> None:
        """Free every sampler, the context and the model. Running sequences are dropped unanswered. What the slots
        hold goes to the host store first, as when a prompt that shares nothing cuts it, so that it outlives the
        instance (an unload, a single-active-backend swap, a scale-down)."""
        for seq in self._running.values():
            seq.sampler.close()
        self._running.clear()
        self._prefilling.clear()
        self._grammars.close()
        if self._prompt_cache is not None:
            for slot in range(self.parallel):
                self._keep_in_cache(slot, [])
                self._lib.llama_memory_seq_rm(self._memory, slot, -1, -1)  # the next slot's cells count alone
                self._cached[slot] = []
            self._prompt_cache.close()  # the writes queued finish: the entries outlive this instance
            self._prompt_cache = None
        if self._draft is not None:
            self._draft.close()
            self._draft = None
        free(self._lib, self._ctx, self._model)
        self._ctx = self._model = None


def _on_wire(changes: Changes) -> wire.CacheChanges:
    return wire.CacheChanges(tuple((i, wire.pack_hashes(summary)) for i, summary in changes.added), changes.dropped)
