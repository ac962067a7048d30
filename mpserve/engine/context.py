"""The llama.cpp context: the model, its KV memory, the batch it decodes, and its vocabulary.

    EngineSettings ──Context(settings, model)──▶ model (loaded, or the zygote's) ─▶ context: parallel sequences of
                                                 n_ctx cells (a stream each, or one pool), warmed up
    batch.add(...) ──decode()──────────────────▶ llama_decode ──▶ logits(row) / the sampler reads ``ctx``
    slot ops ──seq_rm / seq_cp / seq_pos_min──▶ the KV memory (what ``cells`` and ``keeping`` change)
             ──read_state / write_state───────▶ a sequence's state as bytes (the host store, slot files)
    text ──tokenize()──▶ tokens ──piece()──▶ bytes (cached), end of generation or not

Everything that calls into llama_cpp for the batched engine is here, so the bookkeeping modules can be driven
by a fake of this class in unit tests.
"""

from __future__ import annotations

import ctypes
import logging
import time
from typing import Any

import numpy as np

from mpserve.config.kv_types import KV_TYPES
from mpserve.errors import BadRequest

from . import slot_file, vocab
from .llama_batch import Batch
from .media import Projector
from .model_info import float_weights, free, load_model, read_chat_template
from .sequence import PROMPT_CHUNK
from .settings import FLASH_ATTN_TYPES, EngineSettings

log = logging.getLogger("mpserve.worker")


class Context:
    def __init__(self, settings: EngineSettings, model: Any = None, projector: Projector | None = None) -> None:
        """``model``: the llama.cpp model of ``settings.path``, loaded already (by the zygote this process was forked
        from, ``mpserve.worker.zygote``), used instead of loading the file; the context owns it from then on."""
        import llama_cpp

        settings.check(llama_cpp.llama_max_parallel_sequences())
        self.lib: Any = llama_cpp
        self.settings = settings
        self._pieces: dict[int, tuple[bytes, bool]] = {}  # token -> (text bytes, end of generation)
        self._eog: list[int] | None = None
        self._tokenized: tuple[str, list[int]] = ("", [])
        self.decode_s = 0.0
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # what Llama(verbose=False) does
        llama_cpp.llama_backend_init()
        self.model: Any = model if model is not None else load_model(llama_cpp, settings.path, settings.n_gpu_layers,
                                                                      settings.repack)
        self.ctx: Any = None
        self.projector = projector  # the model's image projector (``mmproj``), if it has one: the zygote's, or ...
        try:
            self.vocab = llama_cpp.llama_model_get_vocab(self.model)
            self.n_vocab: int = llama_cpp.llama_vocab_n_tokens(self.vocab)
            bos = llama_cpp.llama_vocab_bos(self.vocab)
            self.bos = [bos] if llama_cpp.llama_vocab_get_add_bos(self.vocab) and bos >= 0 else []
            capacity = max(PROMPT_CHUNK, settings.parallel)  # most tokens one decode holds
            self.ctx = self._create(capacity)
            if settings.mmproj and self.projector is None:  # ... loaded here
                self.projector = Projector(settings.mmproj, self.model, settings.threads, settings.n_gpu_layers != 0)
                log.info("loaded the projector %s", settings.mmproj)
        except BaseException:
            self.close()
            raise
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        n_swa = llama_cpp.llama_model_n_swa(self.model)
        self.recurrent = bool(llama_cpp.llama_model_is_recurrent(self.model)
                              or llama_cpp.llama_model_is_hybrid(self.model))
        self.n_swa = max(1, n_swa)  # llama-server's bound for what must stay
        self.cut_back = not (n_swa > 0 or self.recurrent)  # whether a restored state may be cut back
        self.float_weights = float_weights(llama_cpp, self.model)  # F32, F16, BF16: never repacked
        self.repacked = settings.repack and not self.float_weights  # what the CPU may repack
        self.identity = self._slot_identity()
        self.batch = Batch(llama_cpp, capacity)
        self.chat = read_chat_template(llama_cpp, self.model, settings.chat_template)

    def _create(self, capacity: int) -> Any:
        settings = self.settings
        params = self.params(capacity, settings.kv_unified)
        params.type_k = KV_TYPES[settings.cache_type_k].ggml_type
        params.type_v = KV_TYPES[settings.cache_type_v].ggml_type
        ctx = self.lib.llama_init_from_model(self.model, params)
        if not ctx:
            raise ValueError(f"cannot create a llama.cpp context (cache types {settings.cache_type_k}/"
                             f"{settings.cache_type_v}, flash attention {settings.flash_attn}; the log has llama.cpp's "
                             "reason)")
        return ctx

    def _slot_identity(self) -> slot_file.Identity:
        """What a slot file saved here must match to be restored here."""
        lib, description, settings = self.lib, ctypes.create_string_buffer(256), self.settings
        lib.llama_model_desc(self.model, description, 256)
        return slot_file.Identity(description.value.decode(errors="replace"), lib.llama_model_n_params(self.model),
                                  lib.llama_model_size(self.model), settings.cache_type_k, settings.cache_type_v,
                                  1 if settings.kv_unified else settings.parallel)

    def params(self, capacity: int, kv_unified: bool) -> Any:
        """The context ``llama_cpp.Llama`` would create with the same flash attention setting (same RoPE
        settings), with ``parallel`` sequences of ``n_ctx`` cells each: a stream of its own each, or one
        shared pool."""
        lib, settings = self.lib, self.settings
        params = lib.llama_context_default_params()
        params.n_ctx = settings.n_ctx * settings.parallel
        params.n_seq_max = settings.parallel
        params.kv_unified = kv_unified
        params.n_batch = capacity
        params.n_ubatch = capacity
        params.n_threads = params.n_threads_batch = settings.threads
        params.flash_attn_type = getattr(lib, FLASH_ATTN_TYPES[settings.flash_attn])
        params.yarn_ext_factor = -1.0
        params.yarn_attn_factor = 1.0
        params.yarn_beta_fast = 32.0
        params.yarn_beta_slow = 1.0
        params.no_perf = True
        return params

    def warm_up(self) -> None:
        """llama.cpp sets up its compute graphs and thread pool on the first decode; do it while loading,
        so the first request does not pay for it."""
        self.batch.n = 0
        self.batch.add(self.bos[0] if self.bos else 0, 0, 0)
        if self.lib.llama_decode(self.ctx, self.batch.view()) != 0:
            raise RuntimeError("llama_decode failed while warming up")
        self.seq_rm(0, -1, -1)
        self.batch.n = 0

    # --- decoding ------------------------------------------------------------------------------------

    def decode(self) -> float:
        """llama_decode of the batch; the seconds it took. It always finds KV cells: a slot holds at most
        n_ctx of them, running or cached, and the context has n_ctx per slot (in a stream of its own, or in
        the shared pool, where llama.cpp takes free cells wherever they are)."""
        decode_started = time.perf_counter()
        rc = self.lib.llama_decode(self.ctx, self.batch.view())
        seconds = time.perf_counter() - decode_started
        self.decode_s += seconds
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with status {rc}")
        return seconds

    def logits(self, row: int) -> np.ndarray[Any, np.dtype[np.float32]]:
        """Row ``row``'s logits from the last decode."""
        return np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, row), (self.n_vocab,))

    # --- the KV memory -------------------------------------------------------------------------------

    def seq_rm(self, slot: int, p0: int, p1: int) -> bool:
        """Remove ``slot``'s cells from ``p0`` to ``p1`` (-1: open); False if the memory cannot cut there
        (removing a whole sequence never fails)."""
        return bool(self.lib.llama_memory_seq_rm(self.memory, slot, p0, p1))

    def seq_cp(self, source: int, slot: int, p0: int, p1: int) -> None:
        self.lib.llama_memory_seq_cp(self.memory, source, slot, p0, p1)

    def seq_pos_min(self, slot: int) -> int:
        """The first position ``slot``'s memory holds (-1: none)."""
        return int(self.lib.llama_memory_seq_pos_min(self.memory, slot))

    def read_state(self, slot: int) -> tuple[Any, int]:
        """Sequence ``slot``'s state (its KV cells) as a byte array, and its size (0: nothing to read)."""
        size = self.lib.llama_state_seq_get_size(self.ctx, slot)
        if not size:
            return None, 0
        buffer = (ctypes.c_uint8 * size)()
        written = self.lib.llama_state_seq_get_data(self.ctx, buffer, size, slot)
        return (buffer, written) if written == size else (None, 0)

    def write_state(self, slot: int, state: Any, size: int) -> bool:
        """Replace sequence ``slot``'s cells with ``state`` (from ``read_state``); False if llama.cpp refused it, which
        leaves the sequence empty."""
        return bool(self.lib.llama_state_seq_set_data(self.ctx, state, size, slot))  # the bytes read; 0: failed

    # --- tokens --------------------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: str) -> list[int]:
        """BOS, then the prompt as create_completion tokenizes it (no specials added, specials parsed).
        The last result is kept: best_slot and admit usually tokenize the same prompt one after the other."""
        if self._tokenized[0] == prompt and self._tokenized[1]:
            return self._tokenized[1]
        tokens = self.bos + self.tokenize(prompt, False)
        self._tokenized = (prompt, tokens)
        return tokens

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        return vocab.tokenize(self.lib, self.vocab, text, add_special, True)

    def detokenize(self, tokens: list[int]) -> str:
        return vocab.detokenize(self.lib, self.vocab, tokens)

    def in_vocabulary(self, tokens: list[int], key: str) -> list[int]:
        outside = next((t for t in tokens if not 0 <= t < self.n_vocab), None)
        if outside is not None:
            raise BadRequest(f"'{key}' has token {outside}; the model's vocabulary has {self.n_vocab} tokens")
        return tokens

    def eog_tokens(self) -> list[int]:
        """The vocabulary's end-of-generation tokens (what ``ignore_eos`` bans), found once."""
        if self._eog is None:
            is_eog = self.lib.llama_vocab_is_eog
            self._eog = [t for t in range(self.n_vocab) if is_eog(self.vocab, t)]
        return self._eog

    def piece_bytes(self, token: int) -> bytes:
        return self.piece(token)[0]

    def text_bytes(self, token: int) -> bytes:
        """``token``'s bytes with a special token as its text (``piece`` gives a generated one's: nothing)."""
        return vocab.piece(self.lib, self.vocab, token)

    def piece(self, token: int) -> tuple[bytes, bool]:
        """``token``'s text bytes, and whether it ends a generation."""
        known = self._pieces.get(token)
        if known is None:
            lib = self.lib
            buffer = ctypes.create_string_buffer(64)
            n = lib.llama_token_to_piece(self.vocab, token, buffer, 64, 0, False)
            if n < 0:
                buffer = ctypes.create_string_buffer(-n)
                n = lib.llama_token_to_piece(self.vocab, token, buffer, -n, 0, False)
            known = (buffer.raw[:n], bool(lib.llama_vocab_is_eog(self.vocab, token)))
            self._pieces[token] = known
        return known

    def close(self) -> None:
        """Free the projector, the context and the model."""
        if self.projector is not None:
            self.projector.close()
            self.projector = None
        free(self.lib, self.ctx, self.model)
        self.ctx = self.model = None
