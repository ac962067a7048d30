"""A request in its slot, and the rules of how its prompt is computed: in chunks, split at marks, saved at
checkpoints.

    admit ──▶ Sequence(slot, prompt, reused) ── phase PREFILL ──next_chunk()──▶ a prompt decode of up to a chunk
                                                     │                         (ended early at a mark)
                                                     └─last prompt token decoded──▶ DECODE: one token a step

    PROMPT_CHUNK     prompt tokens per decode, from position 0; with ``reuse: exact`` the unit of reuse
    SCORED_CHUNK     ... for a prompt whose every row is scored (prompt_logprobs)
    TAIL_MARKS       where a prompt's cells are saved before its end (``reuse: any``, no cutting back)
    whole_chunks / whole_cells / usable   what of a prefix ``reuse: exact`` may start from
    reaches_checkpoint                     where a long prompt's cells are saved (no cutting back)

Pure: no llama.cpp here. The modules that use these rules: ``scheduler`` (which rows decode next), ``cells``
(what a slot holds), ``keeping`` (what goes to the host store), ``batch`` (the step).
"""

from __future__ import annotations

import time
from collections import deque
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what a sequence carries; their modules import llama_cpp, which the rules here need not
    from .interface import OnToken
    from .logprobs import LogprobsRecorder
    from .media import Image
    from .sampling import SamplerChain, TextStream
    from .speculation import Drafter
    from .thinking import Phases

PROMPT_CHUNK = 512
"""Prompt tokens per llama_decode, from position 0: llama_cpp.Llama's batch size (n_batch), so a prompt
is computed in the decodes create_completion makes. Also the prompt tokens per step while no sequence is
decoding, and with ``reuse: exact`` the unit of reuse: cells are reused or copied in whole chunks only."""

SCORED_CHUNK = 64
"""Prompt tokens per llama_decode for a prompt whose every row is scored (``prompt_logprobs``). Each row's
logits take a vocabulary's worth of floats, and llama.cpp keeps the largest output buffer a context ever
needed until the context is freed: scored in whole prompt chunks, one echo request on a model with a large
vocabulary would leave the instance holding far more memory than its KV cells. These cells are not computed
in prompt chunks, so with ``reuse: exact`` they are never reused, copied or kept in the host store
(``whole_cells``)."""

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


class Phase(Enum):
    """A sequence's phase in its slot (llama.cpp's server calls these slot states):

        admit ──▶ PREFILL ──last prompt chunk decoded, first token sampled──▶ DECODE ──┐
                  (PROMPT_CHUNK tokens a decode, or whole                  ▲           │ one token a step
                   chunks of cells copied from another slot)               └───────────┘
        either ──stop / length / cancelled──▶ finished: out of the batch, its KV cells stay for reuse
    """

    PREFILL = "prefill"
    DECODE = "decode"


class Sequence:
    """One admitted request in its slot."""

    __slots__ = ("slot", "prompt", "n_past", "reused", "max_tokens", "sampler", "text", "on_token", "generated",
                 "phase", "next_token", "output_row", "pieces", "admitted_at", "first_token_at", "cancel_requested",
                 "logprobs", "carried", "replay", "ahead", "eog", "score_prompt", "drafter", "drafts", "marks",
                 "adapters", "space", "salt", "alone", "images", "saved_at")

    def __init__(self, slot: int, prompt: list[int], reused: int, max_tokens: int, sampler: SamplerChain | Phases,
                 text: TextStream, on_token: OnToken, salt: bytes = b"") -> None:
        self.slot = slot
        self.prompt = prompt
        self.salt = salt  # its reuse namespace (``mpserve.wire.salt``): it shares cells only with the same
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
        self.replay: deque[int] = deque()  # those still to decode, in place of sampling (``replay``)
        self.ahead = 0  # those decoded this step after ``next_token``, in the same llama_decode (``Scheduler.runs``)
        self.eog = -1  # the end-of-generation token that ended it, if one did (reported by ``tokens``)
        self.score_prompt = False  # prompt_logprobs: every prompt token's row is scored, nothing is reused
        self.drafter: Drafter | None = None  # its model speculates
        self.drafts: list[int] = []  # this step's drafts, in the rows after ``output_row``
        self.marks: tuple[int, ...] = ()  # cells where its prefill decodes are split and its cells saved (TAIL_MARKS)
        self.adapters: tuple[tuple[str, float], ...] = ()  # its LoRA adapters and scales (``adapters``); (): none
        self.space = b""  # the adapters' loads its cells are computed under (in its salt too: ``BatchEngine.admit``)
        self.alone = False  # its next prompt chunk is the next step's only decode (``Scheduler.urgent``)
        self.images: dict[int, Image] = {}  # the prompt's images by the position each starts at (``media``)
        self.saved_at = self.admitted_at  # its cells last saved for a hand-over (``live``), on perf_counter

    def kv_tokens(self) -> list[int]:
        """The tokens whose KV cells it holds: its prompt and generated tokens decoded so far."""
        return (self.prompt + self.generated)[:self.n_past]


def whole_chunks(n: int) -> int:
    """``n`` cut down to whole prompt chunks."""
    return n - n % PROMPT_CHUNK


def usable(n: int, exact: bool) -> int:
    """Of ``n`` leading cells or prompt tokens, how many a prompt may start from: all with ``reuse: any``, whole
    prompt chunks with ``exact``."""
    return whole_chunks(n) if exact else n


def whole_cells(seq: Sequence) -> int:
    """The leading cells of ``seq`` computed as whole prompt chunks (none for a scored prompt)."""
    return 0 if seq.score_prompt else whole_chunks(min(seq.n_past, len(seq.prompt)))


def reaches_checkpoint(start: int, end: int) -> bool:
    """Whether a chunk that computed cells ``start`` to ``end`` reached a checkpoint: PROMPT_CHUNK times a power of
    two. Where saved states cannot be cut back, a prompt's cells are saved after each such chunk, so that a later
    prompt sharing part of a long one restores about half of what it shares or more, while a prompt's entries take
    a few times a state's windowed cells and about twice its longest entry's other cells."""
    mark = PROMPT_CHUNK
    while mark <= start:
        mark *= 2
    return mark <= end


def tail_marks(n_prompt: int, reused: int) -> tuple[int, ...]:
    """Where a prompt of ``n_prompt`` tokens that starts from ``reused`` cells is split and its cells saved before its
    end (TAIL_MARKS): only past a chunk computed."""
    return tuple(mark for mark in (n_prompt - before for before in TAIL_MARKS) if mark >= reused + PROMPT_CHUNK)


def next_chunk(seq: Sequence) -> int:
    """The prompt tokens ``seq`` computes in its next prefill decode: a chunk, ended early at its next mark, where its
    cells are saved (``Sequence.marks``), or at its next image; an image is a decode of its own, whole."""
    image = seq.images.get(seq.n_past)
    if image is not None:
        return len(image.ids)
    n = min(SCORED_CHUNK if seq.score_prompt else PROMPT_CHUNK, len(seq.prompt) - seq.n_past)
    ends = (*seq.marks, *seq.images)
    return min((end - seq.n_past for end in ends if seq.n_past < end < seq.n_past + n), default=n)
