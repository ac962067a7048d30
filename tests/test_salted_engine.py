"""The real engine on the tiny model keeps reuse salts apart (``mpserve.wire.salt``): a prompt computed under
one salt is reused, copied from another slot, and restored from the host store by another instance under that salt
only; the empty salt (the default tenant) reuses as before."""

from __future__ import annotations

from pathlib import Path

import pytest
from engines import LONG_PROMPT, N_CTX, copying

from mpserve.engine.batch import BatchEngine
from mpserve.engine.interface import Completion
from mpserve.engine.settings import EngineSettings
from mpserve.wire.protocol import GenerateParams
from mpserve.wire.salt import reuse_salt

pytestmark = pytest.mark.timeout(120)

SA, SB = reuse_salt("key:" + "a" * 16, None, ()), reuse_salt("key:" + "b" * 16, None, ())


def engine(model_path: str, store: Path) -> BatchEngine:
    return copying(BatchEngine(EngineSettings(model_path, n_ctx=N_CTX, parallel=2, threads=1, n_gpu_layers=0,
                                              cache_ram=64 << 20, cache_shm=str(store))))


def run(e: BatchEngine, slot: int, prompt: str, salt: bytes) -> Completion:
    e.admit(slot, prompt, GenerateParams(max_tokens=2, temperature=0.0), lambda text, n: True, salt=salt)
    while True:
        done = dict(e.step())
        if slot in done:
            return done[slot]


def test_a_prompt_is_reused_in_its_slot_copied_and_restored_under_its_own_salt_only(
        tiny_model_path: str, tmp_path: Path) -> None:
    first = engine(tiny_model_path, tmp_path)
    try:
        assert run(first, 0, LONG_PROMPT, SA).reused_tokens == 0
        assert run(first, 1, LONG_PROMPT + " and more", SB).reused_tokens == 0  # slot 0's cells are A's
        assert run(first, 1, LONG_PROMPT + " and again", SA).reused_tokens > 0  # copied from slot 0: A's own
        assert run(first, 0, LONG_PROMPT + " and last", b"").reused_tokens == 0  # the default tenant's: none
    finally:
        first.close()  # every slot's cells go to the store, each under its salt
    second = engine(tiny_model_path, tmp_path)  # another instance on the host, sharing its store
    try:
        fresh = run(second, 0, LONG_PROMPT + " from the store", reuse_salt("key:" + "c" * 16, None, ()))
        assert fresh.reused_tokens == 0
        restored = run(second, 1, LONG_PROMPT + " from the store", SB)  # what B's slot lost to A's copy
        assert restored.reused_tokens > 0
        assert second.stats().prompt_tokens_restored == restored.reused_tokens
    finally:
        second.close()
