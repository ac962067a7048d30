"""With ``reuse: exact`` a generating sequence's cells are saved to the host store now and then
(``mpserve.engine.live``), and an instance that goes on with it after its own was lost restores them instead of
decoding its carried tokens one a step: the text stays the uninterrupted run's, token for token, and it goes on within
a few steps. Through real servers: an instance terminated mid-request saves them before it leaves, and the one it is
handed to restores them."""

from __future__ import annotations

import itertools
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import RealModel, ServerProcess
from engines import N_CTX
from helpers import caught_mid_request, server_idle, wait_for

from mpserve import Client
from mpserve.engine.batch import BatchEngine
from mpserve.engine.interface import Completion
from mpserve.engine.settings import EngineSettings
from mpserve.models.builtin import builtin_model_path
from mpserve.wire.protocol import GenerateParams

PROMPT = "Once upon a time"
TOKENS = 300
CUT = 250  # the tokens the lost instance had generated


def settings(model: str, store: Path, reuse: str = "exact", repack: bool = True) -> EngineSettings:
    """An engine whose generating sequences' cells are saved at every step (``live_save_s`` 0)."""
    return EngineSettings(model, n_ctx=N_CTX, parallel=2, threads=1, n_gpu_layers=0, reuse=reuse, repack=repack,
                          cache_ram=64 << 20, cache_shm=str(store), live_save_s=0.0)


def greedy(max_tokens: int, **kw: object) -> GenerateParams:
    return GenerateParams(max_tokens=max_tokens, temperature=0.0, **kw)  # type: ignore[arg-type]


def run_to(engine: BatchEngine, params: GenerateParams, cut: int | None,
           carried: list[int] | None = None) -> tuple[Completion | None, list[str], list[int], int]:
    """``PROMPT`` in slot 0 of ``engine``, stepped until it ends (None) or has generated ``cut`` tokens (the
    instance is lost there: nothing more is stepped): its completion, the pieces streamed, its token ids as the
    worker reports them, and the steps taken."""
    pieces: list[str] = []
    engine.admit(0, PROMPT, params, lambda text, n: pieces.append(text) is None, carried or [])
    for steps in itertools.count(1):
        for _, completion in engine.step():
            return completion, pieces, list(engine.tokens(0)), steps
        if cut is not None and len(engine.tokens(0)) >= cut:
            return None, pieces, list(engine.tokens(0)), steps
    raise AssertionError("unreachable")


def entries(store: Path) -> int:
    return len(list(store.rglob("*.kv")))


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(builtin_model_path("tiny"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("params", [greedy(TOKENS), greedy(TOKENS, repeat_penalty=1.3)], ids=["plain", "penalty"])
def test_a_sequence_handed_over_restores_its_saved_cells_and_goes_on_as_if_never_interrupted(
        tiny: str, tmp_path: Path, params: GenerateParams) -> None:
    """The lost instance never says it leaves (a SIGKILL): what its steps saved is all there is. The penalty case
    checks that the restored tokens reach the sampler (its penalties), as decoded ones do."""
    whole_engine = BatchEngine(settings(tiny, tmp_path / "whole"))
    try:
        whole, whole_pieces, _, _ = run_to(whole_engine, params, None)
    finally:
        whole_engine.close()
    assert whole is not None and whole.completion_tokens == TOKENS
    store = tmp_path / "shm"
    lost = BatchEngine(settings(tiny, store))
    try:
        _, _, tokens, _ = run_to(lost, params, CUT)
    finally:
        lost.close()  # as a SIGKILL after its writer's last write: no keep_running, no more saves, its queue written
    assert entries(store) == 1  # the sequence's live entry: each replaced the last
    resumer = BatchEngine(settings(tiny, store))
    try:
        resumed, pieces, _, steps = run_to(resumer, params, None, tokens)
        restored = resumer.stats().carried_tokens_restored
    finally:
        resumer.close()
    assert resumed is not None
    assert resumed.text == whole.text and resumed.finish_reason == whole.finish_reason
    assert "".join(whole_pieces[:len(tokens)]) + "".join(pieces) == whole.text  # nothing repeated or missing
    assert 0 < restored <= len(tokens) - 1  # the last one was sampled, never decoded: it has no cell
    assert steps == TOKENS - restored - 1  # a token a step: those not restored, taken or sampled
    wait_for(lambda: not entries(store), 10, "the sequence's live entries forgotten once it ended")


@pytest.mark.timeout(120)
def test_with_reuse_any_nothing_is_saved_live(tiny: str, tmp_path: Path) -> None:
    """``reuse: any`` decodes carried tokens in runs (``replay``): no live entry is written."""
    engine = BatchEngine(settings(tiny, tmp_path, reuse="any"))
    try:
        run_to(engine, greedy(TOKENS), CUT)
        engine.keep_running()  # a leaving instance's save, waited for: nothing for any
    finally:
        engine.close()
    assert entries(tmp_path) == 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("which", "told", "restored"), [("real_model", 40, 39), ("real_model", 30, 0),
                                                         ("smollm2", 30, 29)], ids=["gemma", "gemma-fewer", "smollm2"])
def test_a_real_model_restores_the_cells_its_leaving_instance_saved_and_stays_exact(
        which: str, told: int, restored: int, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """The lost instance leaves after 40 tokens (``keep_running``: the cells of all but the last); the resumer is
    told of ``told`` of them. Gemma 3 270M's windowed layers keep only the cells the next token attends to, so its
    saved state is never cut back: it restores the entry only where that holds no more than the carried tokens it may
    restore, and told of fewer, it decodes them all one a step. SmolLM2 (llama, quantized weights, several rows a
    decode under ``exact`` where the CPU runs them repacked) restores the entry cut back to what it was told of."""
    model: RealModel = request.getfixturevalue(which)
    params = greedy(60, ignore_eos=True)
    make: Callable[[Path], BatchEngine] = lambda store: BatchEngine(  # noqa: E731
        settings(model.path, store, repack=model.repack))
    whole_engine = make(tmp_path / "whole")
    try:
        whole, _, _, _ = run_to(whole_engine, params, None)
    finally:
        whole_engine.close()
    store = tmp_path / "shm"
    lost = make(store)
    try:
        _, _, tokens, _ = run_to(lost, params, 40)
        lost.keep_running()
    finally:
        lost.close()
    resumer = make(store)
    try:
        resumed, _, _, _ = run_to(resumer, params, None, tokens[:told])
        assert resumer.stats().carried_tokens_restored == restored
    finally:
        resumer.close()
    assert whole is not None and resumed is not None and resumed.text == whole.text


@pytest.mark.timeout(120)
def test_an_instance_terminated_mid_request_saves_it_before_leaving_and_the_next_restores_it(
        start_server: type[ServerProcess], tmp_path: Path) -> None:
    store = tmp_path / "shm"
    server = start_server("--instances", "2", "--reuse", "exact", "--cache-shm", str(store),
                          "--cache-ram", "64MiB").wait_ready()
    with Client(server.address) as client, Client(server.address) as observer:
        whole = client.generate(PROMPT, max_tokens=1500, temperature=0, ignore_eos=True, timeout=120)
        for _ in range(5):  # again where the request ended before it was caught far from its end
            stream = client.stream(PROMPT, max_tokens=1500, temperature=0, ignore_eos=True, timeout=120)
            chunks = iter(stream)
            texts = [next(chunks)]
            row = caught_mid_request(server.slots, 1500, lambda: server_idle(observer))
            if row is not None and row.tokens >= 3:
                break
            if row is not None:
                os.kill(row.pid, signal.SIGCONT)
            list(chunks)
        else:
            pytest.fail("the request ended five times before its instance was caught with three tokens or more")
        os.kill(row.pid, signal.SIGTERM)  # noted now, acted on after the step it is stopped in
        os.kill(row.pid, signal.SIGCONT)
        texts += list(chunks)
    result = stream.result
    assert result is not None and result.text == whole.text == "".join(texts)
    assert result.timings.attempts == 2
    handing = [line for line in server.log if "resum" in line or "leaving" in line or "restored" in line]
    wait_for(lambda: any("restored the cells of" in line for line in server.log), 10,
             "the resumer's log line; the hand-over's lines:\n" + "\n".join(handing))
    assert not server.tracebacks(), "\n".join(server.log)
