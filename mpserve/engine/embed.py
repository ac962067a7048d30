"""``EmbeddingEngine``: a model served with ``embedding: true``, one pooled vector per input.

    embed([text or token ids, ...])
        ──▶ tokens: a text with BOS, special tokens not parsed (as ``Llama.embed`` tokenizes it)
        ──▶ batches of whole inputs, one sequence each, as many as fit ``n_ctx`` tokens and ``MAX_INPUTS_PER_DECODE``
            sequences: ONE llama_decode per batch, every row an output
        ──▶ llama_get_embeddings_seq per sequence: pooled by the GGUF's pooling type, or the configured one
            (mean, cls, last), then L2-normalised as OpenAI and llama-server return them
    rank(query, [document, ...])   a reranker (pooling rank: its GGUF has a rank head)
        ──▶ per document the pair's tokens ──▶ the same batches ──▶ the rank head's first output: its score
        ──▶ the cells are cleared for the next batch

A pooled vector equals ``llama_cpp.Llama(embedding=True).embed``'s for the same input up to the norm (that
one is not normalised) and the rounding of a different batch. The engine has slots for the worker's slot
table but generates nothing: ``admit`` refuses, and the broker never sends it a completion.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from mpserve.errors import BadRequest
from mpserve.wire import protocol as wire
from mpserve.wire.protocol import ChatTemplate, GenerateParams

from . import vocab
from .interface import Completion, NoAdapters, NoCells, OnToken
from .model_info import free, load_model

POOLING = {"mean": "LLAMA_POOLING_TYPE_MEAN", "cls": "LLAMA_POOLING_TYPE_CLS", "last": "LLAMA_POOLING_TYPE_LAST",
           "rank": "LLAMA_POOLING_TYPE_RANK"}
"""``pooling`` settings and llama.cpp's names; unset: the GGUF's."""

MAX_INPUTS_PER_DECODE = 64
"""Sequences one decode may hold (the context's ``n_seq_max``); more inputs take more decodes."""


class EmbeddingEngine(NoCells, NoAdapters):
    chat = ChatTemplate()

    def __init__(self, path: str, n_ctx: int, parallel: int, threads: int, n_gpu_layers: int,
                 pooling: str | None = None, repack: bool = True, model: Any = None) -> None:
        """``model``: the llama.cpp model of ``path``, loaded already (as ``BatchEngine`` takes it)."""
        import llama_cpp

        if pooling is not None and pooling not in POOLING:
            raise ValueError(f"pooling must be one of {', '.join(POOLING)}, got {pooling!r}")
        self._lib = llama_cpp
        self.parallel = parallel
        self.n_ctx = n_ctx
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
        llama_cpp.llama_backend_init()
        self._model: Any = model if model is not None else load_model(llama_cpp, path, n_gpu_layers, repack)
        self._ctx: Any = None
        try:
            self._vocab = llama_cpp.llama_model_get_vocab(self._model)
            self._n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)
            self.dim = llama_cpp.llama_model_n_embd(self._model)
            self._seqs = min(MAX_INPUTS_PER_DECODE, llama_cpp.llama_max_parallel_sequences())
            params = llama_cpp.llama_context_default_params()
            params.n_ctx = params.n_batch = params.n_ubatch = n_ctx  # an input is decoded whole
            params.n_seq_max = self._seqs
            params.kv_unified = True  # one pool of n_ctx cells, whatever the inputs' lengths
            params.n_threads = params.n_threads_batch = threads
            params.embeddings = True
            params.pooling_type = getattr(llama_cpp, POOLING[pooling]) if pooling else (
                llama_cpp.LLAMA_POOLING_TYPE_UNSPECIFIED)
            params.no_perf = True
            self._ctx = llama_cpp.llama_init_from_model(self._model, params)
            if not self._ctx:
                raise ValueError("cannot create a llama.cpp context")
            self.reranker = llama_cpp.llama_pooling_type(self._ctx) == llama_cpp.LLAMA_POOLING_TYPE_RANK
            if self.reranker:  # the rank head's outputs, not a hidden state
                self.dim = llama_cpp.llama_model_n_cls_out(self._model)
            if llama_cpp.llama_pooling_type(self._ctx) == llama_cpp.LLAMA_POOLING_TYPE_NONE:
                raise ValueError("the model's GGUF declares no pooling type, so it has no vector per input; set "
                                 f"pooling: {', '.join(POOLING)} in its models[] entry")
        except BaseException:
            self.close()
            raise
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self._batch = llama_cpp.llama_batch_init(n_ctx, 0, 1)
        self.decodes = 0  # llama_decode calls so far

    # --- embeddings ---------------------------------------------------------------------------------

    def embed(self, inputs: list[str | list[int]]) -> tuple[np.ndarray, int]:
        """One L2-normalised vector per input (rows of float32), and the input tokens there were."""
        if self.reranker:
            raise BadRequest("this model is a reranker (pooling: rank): it scores documents against a query "
                             "(/v1/rerank, Client.rerank), it has no embeddings")
        vectors, tokens = self._pooled([self._input_tokens(i, value) for i, value in enumerate(inputs)])
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        return vectors / np.where(norms > 0, norms, 1), tokens

    def rank(self, query: str, documents: list[str]) -> tuple[np.ndarray, int]:
        """Each document's score against ``query``: the rank head's first output for the pair's tokens (as
        llama-server lays a pair out without a rerank template: BOS, the query, EOS, SEP where the vocabulary
        has one, the document, EOS), and the tokens there were."""
        if not self.reranker:
            raise BadRequest("this model is not a reranker: serve one with pooling: rank (its GGUF needs a rank "
                             "head) to rerank with it")
        lib, vocab = self._lib, self._vocab
        sep = [lib.llama_vocab_sep(vocab)] if lib.llama_vocab_sep(vocab) >= 0 else []
        eos = [lib.llama_vocab_eos(vocab)]
        head = [lib.llama_vocab_bos(vocab), *self._tokenize(query, False, False), *eos, *sep]
        pairs = [self._input_tokens(i, head + self._tokenize(doc, False, False) + eos)
                 for i, doc in enumerate(documents)]
        scores, tokens = self._pooled(pairs)
        return scores[:, 0].copy(), tokens

    def _pooled(self, tokenized: list[list[int]]) -> tuple[np.ndarray, int]:
        """The pooled output of each input, decoded as many at once as fit, and the tokens there were."""
        out = np.zeros((len(tokenized), self.dim), np.float32)
        start = 0
        while start < len(tokenized):
            end, room = start, self.n_ctx
            while end < len(tokenized) and end - start < self._seqs and len(tokenized[end]) <= room:
                room -= len(tokenized[end])
                end += 1
            self._decode(tokenized[start:end], out[start:end])
            start = end
        return out, sum(map(len, tokenized))

    def _input_tokens(self, i: int, value: str | list[int]) -> list[int]:
        tokens = self._tokenize(value, True, False) if isinstance(value, str) else value
        outside = next((t for t in tokens if not 0 <= t < self._n_vocab), None)
        if outside is not None:
            raise BadRequest(f"'input' {i} has token {outside}; the model's vocabulary has {self._n_vocab} tokens")
        if not tokens:
            raise BadRequest(f"'input' {i} has no tokens")
        if len(tokens) > self.n_ctx:
            raise BadRequest(f"'input' {i} is {len(tokens)} tokens; the context holds {self.n_ctx}")
        return tokens

    def _decode(self, inputs: list[list[int]], out: np.ndarray) -> None:
        lib, batch = self._lib, self._batch
        n = 0
        for seq, tokens in enumerate(inputs):
            for pos, token in enumerate(tokens):
                batch.token[n], batch.pos[n], batch.n_seq_id[n], batch.logits[n] = token, pos, 1, 1
                batch.seq_id[n][0] = seq
                n += 1
        batch.n_tokens = n
        lib.llama_memory_clear(self._memory, True)
        rc = lib.llama_decode(self._ctx, batch)
        self.decodes += 1
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with status {rc}")
        for seq in range(len(inputs)):
            out[seq] = np.ctypeslib.as_array(lib.llama_get_embeddings_seq(self._ctx, seq), (self.dim,))

    # --- the Engine interface: slots for the table, no generation ----------------------------------

    def free_slots(self) -> list[int]:
        return list(range(self.parallel))

    def admit(self, slot: int, prompt: str | list[int], params: GenerateParams, on_token: OnToken,
              carried: Sequence[int] = (), adapters: Sequence[tuple[str, float]] = (), salt: bytes = b"",
              alone: bool = False, images: Sequence[bytes] = ()) -> None:
        raise BadRequest("this model is served with embedding: true; it computes embeddings, not completions")

    def tokens(self, slot: int) -> Sequence[int]:
        return ()

    def take_logprobs(self, slot: int) -> wire.Logprobs | None:
        return None

    def cancel(self, slot: int) -> None:
        """Nothing runs in a slot."""

    def park(self, slot: int, key: str) -> bool:
        return False  # nothing runs in a slot

    def resume(self, key: str, slot: int, on_token: OnToken) -> bool:
        return False  # nothing was parked

    def drop(self, key: str) -> None:
        """Nothing is parked."""

    def step(self) -> list[tuple[int, Completion]]:
        return []

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        return self._tokenize(text, add_special, True)

    def _tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        return vocab.tokenize(self._lib, self._vocab, text, add_special, parse_special)

    def token_bytes(self, token: int) -> bytes:
        if not 0 <= token < self._n_vocab:
            raise BadRequest(f"'tokens' has token {token}; the model's vocabulary has {self._n_vocab} tokens")
        return vocab.piece(self._lib, self._vocab, token)

    def close(self) -> None:
        if getattr(self, "_batch", None) is not None:
            self._lib.llama_batch_free(self._batch)
            self._batch = None
        free(self._lib, self._ctx, self._model)
        self._ctx = self._model = None
