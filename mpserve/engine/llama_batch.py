"""A llama_batch over numpy arrays (``Batch``), filled a row or a run of rows at a time and handed to
llama_decode as it is: the target's decodes (``mpserve.engine.batch``) and the draft model's
(``mpserve.engine.draft``) use one each.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np


class Batch:
    """A llama_batch over numpy arrays this object owns, so prompt chunks are written a slice at a time.
    Every row belongs to one sequence: ``seq_id[i]`` points at ``seq[i]``."""

    def __init__(self, lib: Any, capacity: int) -> None:
        self.n = 0
        self.token = np.zeros(capacity, np.int32)
        self.pos = np.zeros(capacity, np.int32)
        self.n_seq_id = np.ones(capacity, np.int32)
        self.seq = np.zeros(capacity, np.int32)
        self.logits = np.zeros(capacity, np.int8)
        int32_p = ctypes.POINTER(ctypes.c_int32)
        self._seq_ptrs = (int32_p * capacity)(
            *(ctypes.cast(self.seq.ctypes.data + 4 * i, int32_p) for i in range(capacity)))
        self._struct = lib.llama_batch(
            n_tokens=0, token=self.token.ctypes.data_as(ctypes.POINTER(lib.llama_token)),
            embd=ctypes.POINTER(ctypes.c_float)(), pos=self.pos.ctypes.data_as(ctypes.POINTER(lib.llama_pos)),
            n_seq_id=self.n_seq_id.ctypes.data_as(int32_p),
            seq_id=ctypes.cast(self._seq_ptrs, ctypes.POINTER(ctypes.POINTER(lib.llama_seq_id))),
            logits=self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )

    def add(self, token: int, pos: int, seq: int) -> int:
        """One token whose logits are wanted; returns its row."""
        i = self.n
        self.token[i] = token
        self.pos[i] = pos
        self.seq[i] = seq
        self.logits[i] = 1
        self.n = i + 1
        return i

    def add_run(self, tokens: list[int], pos: int, seq: int) -> int:
        """Consecutive tokens of one sequence, no logits; returns the last row."""
        i, j = self.n, self.n + len(tokens)
        self.token[i:j] = tokens
        self.pos[i:j] = np.arange(pos, pos + len(tokens), dtype=np.int32)
        self.seq[i:j] = seq
        self.logits[i:j] = 0
        self.n = j
        return j - 1

    def view(self) -> Any:
        """The llama_batch of the rows added so far."""
        self._struct.n_tokens = self.n
        return self._struct
