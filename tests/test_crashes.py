"""Crashes a request causes, told apart from the engine's, through a real server whose workers crash on
purpose: with ``$MPSERVE_TEST_CRASH_ON`` set (``mpserve.worker.loop``), a worker admitting a prompt that
contains its value dies of SIGSEGV, as an engine that faults on a request does. (Kills from outside, which
are no crash of the request: tests/test_failover.py and the chaos test in tests/test_faults.py.)"""

from __future__ import annotations

import pytest
from helpers import wait_for

from mpserve import Client
from mpserve.errors import ErrorCode, ModelFailed, MpserveError, PoisonRequest
from mpserve.server.routing import MODEL_CRASHES
from mpserve.wire.slots import SlotState
from mpserve.worker.loop import CRASH_ON

MARKER = "CRASH-HERE"


@pytest.mark.timeout(120)
def test_a_request_that_crashes_its_worker_is_poison_after_two_workers_and_the_model_serves_on(start_server) -> None:
    server = start_server("--instances", "2", env={CRASH_ON: MARKER}).wait_ready()
    with Client(server.address) as client:
        with pytest.raises(PoisonRequest) as poison:
            client.generate(f"{MARKER}, then more", max_tokens=8, temperature=0, timeout=60)
        assert "running on 2 workers that crashed or stalled" in poison.value.message
        assert client.generate("Hello", max_tokens=8, temperature=0, timeout=60).usage.completion_tokens == 8
        stats = client.stats()
    assert stats.counters.get("worker_crashed") == 2 and stats.models["tiny"].failed is None
    assert sum("exited with signal SIGSEGV; restarting" in line for line in server.log) == 2
    assert not server.tracebacks(), "\n".join(server.log)


@pytest.mark.timeout(180)
def test_a_model_whose_workers_crash_on_every_request_fails_naming_the_signal_and_the_setting(start_server) -> None:
    """One request after another, each crashing every worker it runs on: the first ones are poison (one request
    alone is no verdict on its model), the one that is the model's MODEL_CRASHES-th different request to crash
    fails the model, with an error that names the signal and the setting to try; the next request is refused
    at once with the same error, and the crashed workers stay down."""
    server = start_server("--instances", "2", env={CRASH_ON: MARKER}).wait_ready()
    with Client(server.address) as client:
        codes = []
        for i in range(MODEL_CRASHES):
            with pytest.raises(MpserveError) as error:
                client.generate(f"{MARKER} number {i}", max_tokens=8, temperature=0, timeout=60)
            codes.append(error.value.code)
        assert codes == [ErrorCode.POISON_REQUEST] * (MODEL_CRASHES - 1) + [ErrorCode.MODEL_FAILED]
        verdict = error.value.message
        assert verdict.startswith(f"model tiny crashed its workers with SIGSEGV on {MODEL_CRASHES} different requests")
        assert "repack: false (--no-repack" in verdict and "n_gpu_layers" in verdict and "flash_attn" in verdict
        with pytest.raises(ModelFailed) as refused:
            client.generate("Hello", max_tokens=8, temperature=0, timeout=60)
        assert refused.value.message == verdict
        assert client.stats().models["tiny"].failed is not None
    wait_for(lambda: any(r.state is SlotState.FAILED for r in server.slots()), 10, "the crashed worker's row failed")
    assert not server.tracebacks(), "\n".join(server.log)
