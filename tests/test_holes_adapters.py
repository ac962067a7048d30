"""A request naming LoRA adapters runs only on an instance that has them loaded, and one naming an adapter the model
does not serve is refused at once, by name, never queued.

    start: 2 instances, a0 declared ──▶ a1 hot loaded (both instances load it) ──▶ its file removed, instance 1
    killed ──▶ its replacement registers with a0 only; the broker's load of a1 fails there (no file)
        ──▶ every a1 request runs on instance 0, with a1's text: none is routed to the one without it
    a request for "zz" ──▶ unknown_adapter, within its own short timeout (queued, it would wait for ever: no
        instance will ever load it)
    1 instance, a1 hot loaded, the instance killed: a request for a1 asked while it restarts waits, and runs
        there (the replacement is sent a1) ──▶ a1's file removed, the instance killed again: one asked while it
        restarts is refused when the replacement's load of a1 fails, and one asked after at once (no_instance,
        naming a1 and the call that loads it again): the model serves a1 and no instance has it
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import llama_cpp
import pytest
from conftest import ServerProcess
from engines import PROMPTS, adapters_for
from helpers import wait_for
from test_adapters import reference

from mpserve import Client
from mpserve.errors import MpserveError, NoInstance, UnknownAdapter
from mpserve.wire.slots import SlotState

REQUESTS = 8  # twice the slots of both instances: the free slots of the instance without a1 are there to take
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(tiny_model_path: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return adapters_for(tiny_model_path, tmp_path_factory.mktemp("adapters"), ("a0", "a1"))


@pytest.fixture(scope="module")
def server(adapters: dict[str, str]) -> Iterator[ServerProcess]:
    server = ServerProcess("--model", "builtin:tiny", "--instances", "2", "--parallel", "2", "--threads", "1",
                           "--reuse", "exact", "--lora", f"a0={adapters['a0']}").wait_ready()
    yield server
    server.stop()


def hot_load_then_lose(server: ServerProcess, adapters: dict[str, str], index: int) -> dict[int, int]:
    """a1 hot loaded from a copy, the copy removed, instance ``index`` killed: the instances once its replacement
    is ready (without a1: its load fails) and the broker has tried."""
    hot = Path(adapters["a1"]).with_name(f"a1-hot-{server.name}.gguf")  # beside a0's: a folder hot loads may read
    shutil.copyfile(adapters["a1"], hot)
    with Client(server.admin) as admin:
        assert "a1" in admin.adapter("load", "tiny", "a1", str(hot)).adapters
    hot.unlink()  # a replacement instance cannot load it now: it serves without a1 for good
    before = live(server)
    os.kill(before[index], signal.SIGKILL)
    after = wait_for(lambda: (now := live(server)).get(index, before[index]) != before[index]
                     and len(now) == len(before) and now, 60, f"instance {index} replaced")
    wait_for(lambda: any("adapter call failed" in line for line in server.log), 30,
             "the replacement's load of a1 to fail")
    return after


def short_request(server: ServerProcess, adapter: str, timeout: float = 5) -> object:
    """What a request for ``adapter`` with a short timeout got: its error, or "it ran"."""
    with Client(server.address) as client:
        try:
            client.generate("hi", adapters={adapter: 1.0}, max_tokens=2, timeout=timeout)
        except MpserveError as exc:
            return exc
    return "it ran"


def live(server: ServerProcess) -> dict[int, int]:
    """The instances ready now: index -> pid."""
    return {r.worker: r.pid for r in server.slots() if r.state in (SlotState.IDLE, SlotState.BUSY)}


@pytest.mark.timeout(180)
def test_an_instance_that_has_not_loaded_an_adapter_is_never_routed_a_request_for_it(
        server: ServerProcess, adapters: dict[str, str], tiny_model_path: str) -> None:
    after = hot_load_then_lose(server, adapters, 1)
    expected = reference(llama_cpp.Llama, tiny_model_path, adapters["a1"], 1.0, PROMPTS[0], MAX_TOKENS)

    def one(i: int) -> str:
        with Client(server.address) as client:
            try:
                result = client.generate(PROMPTS[0], adapters={"a1": 1.0}, max_tokens=MAX_TOKENS, temperature=0,
                                         timeout=60)
            except MpserveError as exc:
                return f"failed: {exc}"
            return result.worker if result.text == expected else f"{result.worker} without a1: {result.text!r}"

    with ThreadPoolExecutor(REQUESTS) as pool:
        ran_on = list(pool.map(one, range(REQUESTS)))
    assert ran_on == ["w0"] * REQUESTS, (
        f"requests for a1 were routed to instance 1 (pid {after[1]}), which has not loaded it: {ran_on}")
    with Client(server.address) as client:  # the replacement serves the rest
        assert client.generate(PROMPTS[1], adapters={"a0": 1.0}, max_tokens=4, timeout=60).text


@pytest.mark.timeout(60)
def test_a_request_for_an_adapter_the_model_does_not_serve_is_refused_at_once_not_queued(
        server: ServerProcess) -> None:
    outcome = short_request(server, "zz")
    assert isinstance(outcome, UnknownAdapter) and "no LoRA adapter 'zz'" in outcome.message, (
        f"a request naming an adapter the model does not serve must be refused at once (unknown_adapter); "
        f"got {outcome!r}")


@pytest.mark.timeout(120)
def test_a_request_for_an_adapter_no_instance_has_loaded_is_refused_not_left_waiting(
        start_server: type[ServerProcess], adapters: dict[str, str]) -> None:
    lone = start_server("--model", "builtin:tiny", "--threads", "1", "--lora", f"a0={adapters['a0']}").wait_ready()
    hot = Path(adapters["a1"]).with_name(f"a1-lone-{lone.name}.gguf")
    shutil.copyfile(adapters["a1"], hot)
    with Client(lone.admin) as admin:
        assert "a1" in admin.adapter("load", "tiny", "a1", str(hot)).adapters
    os.kill(live(lone)[0], signal.SIGKILL)  # asked while its replacement starts: it waits for it, which loads a1
    assert short_request(lone, "a1", timeout=40) == "it ran", "a request that came while the instance restarted"
    hot.unlink()  # the next replacement cannot load a1: one asked while it starts ends when its load fails
    os.kill(live(lone)[0], signal.SIGKILL)
    outcome = short_request(lone, "a1", timeout=40)
    assert isinstance(outcome, NoInstance) and "adapter 'a1'" in outcome.message, (
        f"a request queued while the instance restarted, whose load of a1 then failed, must be refused; "
        f"got {outcome!r}")
    outcome = short_request(lone, "a1")
    assert isinstance(outcome, NoInstance) and "adapter 'a1'" in outcome.message and (
        "mpserve adapters load tiny" in outcome.message), (
        f"a request for an adapter no instance has loaded must be refused (no_instance, naming it and how to load it "
        f"again), not left waiting; got {outcome!r}")
