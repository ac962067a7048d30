"""Which rows go into the next decodes: the running sequences by slot, the prompts by admission order.

    admit ──add(seq)──▶ running[slot], prefilling (admission order; a parked sequence resumed: while its prompt
                        is not all computed)
    step  ──cancelled()──▶ the sequences a cancel ended
          ──urgent()─────▶ a prompt admitted to go first (of higher priority, or a newcomer while others decode):
                           its next chunk is the step's only decode, or else
          ──decoding()───▶ DECODE sequences in slot order ──decodes()──▶ grouped into llama_decode calls
                                                     (``reuse: exact``: at most ``together_rows`` a call)
          ──runs(decoding, free rows)──▶ carried tokens decoded with a resumed sequence's next one (``replay``)
          ──chunks(any decoding, turn)──▶ the prompts computing their next chunk this step, within the token budget
                                          (those of the adapter set whose turn it is: ``adapters.Turns``)
          ──twins(lead)──▶ prompts equal to one just computed, under the same adapters (``cells.share`` gives
                           them its cells)
    finish ──remove(seq)──▶ out of the batch

Rows go in slot order: with a KV stream per slot, llama.cpp puts only consecutive sequence ids, in order, in one
micro-batch, and every micro-batch is one more pass over the weights. Pure: no llama.cpp here.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable

from mpserve.wire.prefix import common_prefix

from .adapters import AdapterSet
from .sequence import PROMPT_CHUNK, Phase, Sequence, next_chunk, usable

LONE_KV_CELLS = 256
"""The most cells a sequence holds and still decodes in a batch with others under ``reuse: exact``: llama.cpp pads
the cells an attention reads to a multiple of 256, and its CPU flash attention gives a lone query over 512 or more
of them a kernel of its own (``decodes``)."""


class Scheduler:
    def __init__(self, step_budget_tokens: int, *, exact: bool, kv_unified: bool, exact_rows: int) -> None:
        """``step_budget_tokens``: the prompt tokens a step computes while sequences decode (at least one chunk);
        while none does, a whole PROMPT_CHUNK; ``exact_rows``: the most rows a decode holds under ``reuse: exact``
        (``mpserve.engine.speculation.exact_rows``)."""
        self._budget = step_budget_tokens
        self._idle_budget = max(step_budget_tokens, PROMPT_CHUNK)
        self._exact, self._kv_unified, self._exact_rows = exact, kv_unified, exact_rows
        self.running: dict[int, Sequence] = {}
        self.prefilling: deque[Sequence] = deque()  # admission order

    def add(self, seq: Sequence) -> None:
        self.running[seq.slot] = seq
        if seq.phase is Phase.PREFILL:
            self.prefilling.append(seq)

    def remove(self, seq: Sequence) -> None:
        del self.running[seq.slot]
        self.prefilled([seq])

    def prefilled(self, seqs: Iterable[Sequence]) -> None:
        """``seqs`` have all their prompt's cells: no more chunks for them."""
        for seq in seqs:
            if seq in self.prefilling:
                self.prefilling.remove(seq)

    def clear(self) -> None:
        self.running.clear()
        self.prefilling.clear()

    def cancelled(self) -> list[Sequence]:
        return [seq for seq in self.running.values() if seq.cancel_requested]

    def urgent(self, turn: AdapterSet = ()) -> Sequence | None:
        """The prompt whose next chunk is this step's only decode: one admitted ahead of every running sequence
        (``Sequence.alone``: a request of higher priority than theirs), else, while sequences of the adapter set in
        ``turn`` decode, the first newcomer of that set whose whole prompt is that chunk (admitted, none of it computed
        yet, no image in it) and that copies no earlier prompt's cells: one of another set waits for its set's turn,
        since each switch of the context's adapters rebuilds llama.cpp's compute graphs. Its chunk and the decoding rows
        are separate llama_decode calls whatever the order, so going first changes none of their numbers and delays
        their tokens by no more than a turn of the loop: the step is split in two, and the newcomer's first token goes
        out after its chunk rather than after the others' decode too. A prompt goes first once, and only an admission
        brings one: the decoding rows wait at most a chunk for each slot that was free. A longer prompt gains nothing
        from it (its first token comes after its last chunk) and takes its chunks within the step's budget."""
        if not self.prefilling:
            return None
        first = next((seq for seq in self.prefilling if seq.alone), None)
        if first is not None or not any(seq.phase is Phase.DECODE and seq.adapters == turn
                                        for seq in self.running.values()):
            return first
        for at, seq in enumerate(self.prefilling):
            if (seq.adapters == turn and seq.n_past == seq.reused and not seq.images
                    and seq.n_past + next_chunk(seq) == len(seq.prompt)
                    and not self._copies(seq, itertools.islice(self.prefilling, at))):
                return seq
        return None

    def decoding(self) -> list[Sequence]:
        """The sequences that decode a token this step, in slot order."""
        return sorted((seq for seq in self.running.values() if seq.phase is Phase.DECODE), key=_by_slot)

    def decodes(self, decoding: list[Sequence]) -> list[list[Sequence]]:
        """The decoding sequences grouped by llama_decode: all in one, except with ``reuse: exact``, where the others
        decode ``exact_rows`` at most a decode (one with float weights: ``together_rows``), a sequence under LoRA
        adapters decodes alone, and so does one with more than LONE_KV_CELLS cells when each slot has a KV stream.
        An adapter's tensors are float, and llama.cpp's CPU multiplies a float matrix by two rows or more with other
        kernels than a lone row (``together_rows``); the base model's quantized weights go through one kernel up to
        ``exact_rows`` rows (as stored: a dot product per row; repacked: a gemv per row up to 3 rows, a gemm of 4
        rows at a time beyond).
        llama.cpp gives a lone query over LONE_KV_CELLS cells its own attention kernel (the CPU's flash attention
        splits the cells among threads and sums the parts), and a batch of several streams another. Decoded
        together, such a sequence gets other numbers than a fresh computation of it, enough to change a greedy
        choice."""
        if not self._exact or len(decoding) < 2:
            return [decoding] if decoding else []
        alone = [seq for seq in decoding
                 if seq.adapters or (not self._kv_unified and seq.n_past + 1 > LONE_KV_CELLS)]
        together = [seq for seq in decoding if seq not in alone]
        rows = self._exact_rows
        return [together[at:at + rows] for at in range(0, len(together), rows)] + [[seq] for seq in alone]

    def runs(self, decoding: list[Sequence], free_rows: int) -> None:
        """How many of its carried tokens each sequence that replays them decodes this step after its next token, in
        the same llama_decode (``Sequence.ahead``; ``mpserve.engine.replay``): in slot order, within a whole chunk while
        only such sequences decode and the step's budget of prompt tokens while others do, and within the batch's
        ``free_rows``. None with ``reuse: exact``. The last carried token is never ahead: it is taken after the decode,
        as one a step takes it, and decoded with the next step's rows."""
        if self._exact:
            return
        replaying = [seq for seq in decoding if seq.replay]
        budget = min(self._idle_budget if len(replaying) == len(decoding) else self._budget, free_rows)
        for seq in replaying:
            seq.ahead = max(0, min(len(seq.replay) - 1, budget))
            budget -= seq.ahead

    def chunks(self, decoding: bool, turn: tuple[tuple[str, float], ...] = ()) -> list[Sequence]:
        """The prompts under the adapters ``turn`` that compute their next chunk this step, in admission order,
        while the step's budget of prompt tokens lasts (the first chunk always: a chunk is never cut);
        ``decoding``: whether sequences decode this step too."""
        budget = self._budget if decoding else self._idle_budget
        chosen: list[Sequence] = []
        for seq in self.prefilling:
            if seq.adapters != turn:
                continue
            if chosen and budget < next_chunk(seq):
                break
            if self._copies(seq, chosen):
                continue  # an earlier prompt is computing this one's next tokens: copy them when it is done
            chosen.append(seq)
            budget -= next_chunk(seq)
        return chosen

    def _copies(self, seq: Sequence, leads: Iterable[Sequence]) -> bool:
        """Whether one of ``leads`` computes ``seq``'s next tokens, for ``seq`` to copy (``cells.share``) rather than
        compute them."""
        return not seq.score_prompt and any(lead.salt == seq.salt and (
            lead.prompt == seq.prompt or self._shared(lead, seq) > seq.n_past) for lead in leads)

    def _shared(self, lead: Sequence, seq: Sequence) -> int:
        """The tokens of ``seq``'s prompt that ``lead``'s cells will hold and ``seq`` may reuse."""
        return usable(min(common_prefix(lead.prompt, seq.prompt), len(seq.prompt) - 1), self._exact)

    def twins(self, lead: Sequence) -> list[Sequence]:
        """The prompts waiting that equal ``lead``'s under its salt (the choices of a request for n), to take its
        cells when its last chunk is decoded."""
        return [seq for seq in self.prefilling
                if seq.prompt == lead.prompt and seq.salt == lead.salt and not seq.score_prompt]


def together_rows(exact_rows: int, float_weights: bool) -> int:
    """The most sequences one decode holds under ``reuse: exact`` (the Scheduler's ``exact_rows``): ``exact_rows``,
    the rows llama.cpp's CPU computes as it computes a lone row (``mpserve.engine.speculation.exact_rows``), with
    quantized weights; one with float weights (F32, F16, BF16). llama.cpp multiplies a float matrix by a lone row
    with its dot products (``ggml_vec_dot_f16``: several vector accumulators, added at the end) and by two rows or
    more with llamafile's tinyBLAS (``llamafile_sgemm`` declines n < 2; one accumulator a dot product), which sum in
    another order: every row of such a decode differs from the lone row a fresh computation decodes, in its last
    bits, and over a long greedy stream that turns a choice. llama.cpp puts the rows of consecutive slots in one
    micro-batch, so no grouping of several float rows avoids it, and a decode a sequence costs what the
    micro-batches of one decode cost: a pass over the weights each."""
    return 1 if float_weights else exact_rows


def _by_slot(seq: Sequence) -> int:
    return seq.slot
