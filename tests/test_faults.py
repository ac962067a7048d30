"""Faults, through a real server: killed, stopped and vanished processes, a model that cannot load,
idle unloading. Real processes, real sockets, the real tiny model; every wait polls a condition under a
deadline. Run with ``pytest -s`` to see the figures the chaos, hang, non-reading-client and broker-kill
tests print.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llama_cpp
import pytest
from helpers import (
    caught_mid_request,
    children,
    dealer,
    mpserve,
    process_state,
    raw_request,
    received,
    running,
    wait_for,
)

from mpserve import AsyncClient, Client
from mpserve.config.loader import ServerConfig
from mpserve.errors import ModelFailed, MpserveError
from mpserve.runtime import ServerInfo
from mpserve.wire import protocol as wire
from mpserve.wire.slots import SlotRow, SlotState

SERVING = (SlotState.IDLE, SlotState.BUSY)
NOT_LIVE = (SlotState.EMPTY, SlotState.DEAD, SlotState.FAILED)  # every other state claims a running worker


# --- helpers ------------------------------------------------------------------------------------

def serving_rows(server: Any) -> list[SlotRow] | None:
    """All rows idle or busy with a running worker of their own, or None."""
    rows = server.slots()
    if all(r.state in SERVING and running(r.pid) for r in rows) and len({r.pid for r in rows}) == len(rows):
        return rows
    return None


def idle_rows(server: Any) -> list[SlotRow] | None:
    rows = server.slots()
    return rows if all(r.state is SlotState.IDLE for r in rows) else None


def published(server_name: str) -> bool:
    """Whether a starting server has published its info file and slot table (before any instance is ready)."""
    info = ServerInfo.read(server_name)
    return info is not None and Path(info.slots).exists()


def dead_owned_live_rows(rows: list[SlotRow]) -> list[SlotRow]:
    """Rows that claim a live state but whose worker process is gone."""
    return [r for r in rows if r.state not in NOT_LIVE and r.pid > 0 and not running(r.pid)]


class CountingClient(AsyncClient):
    """An AsyncClient that also counts the terminal messages (DONE/ERROR) that reach it, per request id,
    straight off the wire, so the test can prove "exactly one" rather than "at least one"."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.terminal: collections.Counter[str | None] = collections.Counter()

    def _deliver(self, frames: list[bytes]) -> None:
        try:
            msg = wire.decode(frames)
        except MpserveError:
            msg = None
        if isinstance(msg, (wire.Done, wire.Error)):
            self.terminal[msg.id] += 1
        super()._deliver(frames)


# --- 1. chaos -----------------------------------------------------------------------------------

CHAOS_REQUESTS = 300
CHAOS_CLIENTS = 8
CHAOS_KILL_EVERY_S = 0.5
CHAOS_REQUEST_TIMEOUT_S = 60.0
CHAOS_RECOVERY_S = 15.0
CHAOS_PROMPTS = ["Hello world", "The quick brown fox", "In the beginning", "1 2 3", "Once upon a time"]
CHAOS_LENGTHS = [50, 150, 300, 500]


@pytest.mark.timeout(240)
def test_chaos_every_request_ends_exactly_once_while_workers_are_killed(start_server) -> None:
    """SIGKILL a random busy worker every 0.5 s under 300 requests from 8 clients: each request ends exactly
    once, DONE: a kill from outside is no crash of the request (no poison_request, no crash counted), streams
    are resumed elsewhere (no worker_lost; no request here lives through the kills that reach the bound on
    hand-overs), none hangs; the kills did hand requests over, both before any text (retried) and mid-stream
    (resumed), each hand-over one more attempt of a request that ended DONE; every text, retried, resumed or
    not, is the whole text an uninterrupted run of the same request gave on the same server before the kills;
    the pool is whole again within 15 s, no row is owned by a dead process, no traceback. With ``reuse: exact``,
    the mode whose handed-over streams keep that text."""
    server = start_server("--instances", "4", "--reuse", "exact").wait_ready()
    rng = random.Random(4004)
    plans = [(rng.choice(CHAOS_PROMPTS), rng.choice(CHAOS_LENGTHS), rng.random() < 0.5)
             for _ in range(CHAOS_REQUESTS)]

    async def uninterrupted() -> dict[tuple[str, int], str]:
        async with AsyncClient(server.address) as client:
            pairs = [(prompt, n) for prompt in CHAOS_PROMPTS for n in CHAOS_LENGTHS]
            results = await asyncio.gather(*(client.generate(prompt, max_tokens=n, temperature=0, timeout=60)
                                             for prompt, n in pairs))
        assert all(r.timings.attempts == 1 for r in results)
        return {pair: r.text for pair, r in zip(pairs, results, strict=True)}

    reference = asyncio.run(uninterrupted())
    outcomes: list[tuple[str, Any]] = []
    kills: list[int] = []
    clients: list[CountingClient] = []

    async def one_request(client: CountingClient, prompt: str, max_tokens: int, stream: bool) -> None:
        try:
            if stream:
                s = client.stream(prompt, max_tokens=max_tokens, temperature=0, timeout=CHAOS_REQUEST_TIMEOUT_S)
                chunks = [text async for text in s]
                assert s.result is not None
                assert "".join(chunks) == s.result.text, "streamed text differs from the final text"
                result = s.result
            else:
                result = await client.generate(prompt, max_tokens=max_tokens, temperature=0,
                                               timeout=CHAOS_REQUEST_TIMEOUT_S)
            assert result.usage.completion_tokens == max_tokens and result.finish_reason == "length"
            outcomes.append(("done", (prompt, stream, result)))
        except MpserveError as exc:
            outcomes.append((exc.code, (prompt, stream, exc)))

    async def client_loop(jobs: collections.deque[tuple[str, int, bool]]) -> None:
        async with CountingClient(server.address) as client:
            clients.append(client)
            while jobs:
                prompt, max_tokens, stream = jobs.popleft()
                try:
                    await asyncio.wait_for(one_request(client, prompt, max_tokens, stream),
                                           CHAOS_REQUEST_TIMEOUT_S + 10)
                except asyncio.TimeoutError:
                    outcomes.append(("hung", (prompt, stream, None)))

    async def killer(stop: asyncio.Event) -> None:
        pick = random.Random(5005)
        while not stop.is_set():
            live = [r.pid for r in server.slots() if r.state is SlotState.BUSY and running(r.pid)]
            if live:
                pid = pick.choice(live)
                os.kill(pid, signal.SIGKILL)
                kills.append(pid)
            try:
                await asyncio.wait_for(stop.wait(), CHAOS_KILL_EVERY_S)
            except asyncio.TimeoutError:
                pass

    async def main() -> float:
        jobs = collections.deque(plans)
        stop = asyncio.Event()
        killing = asyncio.create_task(killer(stop))
        started = time.monotonic()
        await asyncio.gather(*(client_loop(jobs) for _ in range(CHAOS_CLIENTS)))
        stop.set()
        await killing
        return time.monotonic() - started

    elapsed = asyncio.run(main())
    stopped_killing = time.monotonic()
    rows = wait_for(lambda: (r := serving_rows(server)) and all(x.state is SlotState.IDLE for x in r) and r,
                    CHAOS_RECOVERY_S, "4 live idle rows after the killing stopped")
    recovered_s = time.monotonic() - stopped_killing

    by_code = collections.Counter(code for code, _ in outcomes)
    done = [detail for code, detail in outcomes if code == "done"]
    retries = sum(r.timings.attempts - 1 for _, _, r in done)
    per_request = collections.Counter(n for c in clients for n in c.terminal.values())  # ids are per client
    print(f"\nchaos: {len(outcomes)} requests from {CHAOS_CLIENTS} clients in {elapsed:.1f} s, "
          f"{len(kills)} workers SIGKILLed (every {CHAOS_KILL_EVERY_S} s); outcomes {dict(by_code)}; "
          f"retries (sum of attempts-1 over done) {retries} on "
          f"{sum(1 for _, _, r in done if r.timings.attempts > 1)} requests; "
          f"pool of 4 back {recovered_s:.2f} s after the killing stopped")
    with Client(server.address) as client:
        counters = client.stats().counters
    print(f"chaos: hand-overs mid-stream (resumed) {counters.get('resumed', 0)}, retried before any text "
          f"{counters.get('retried', 0)}, worker_lost {counters.get('worker_lost', 0)}")

    assert len(outcomes) == CHAOS_REQUESTS
    assert set(by_code) == {"done"}, dict(by_code)
    assert per_request == {1: CHAOS_REQUESTS}, f"terminal messages per request: {per_request}"
    assert not any(None in c.terminal for c in clients), "an ERROR without a request id"
    assert len(kills) >= 4, "the chaos did not kill enough workers to mean anything"
    assert counters.get("resumed", 0) > 0 and counters.get("retried", 0) > 0, counters
    assert retries == counters["resumed"] + counters["retried"], (retries, counters)
    assert counters.get("worker_crashed", 0) == counters.get("poison_request", 0) == 0, counters
    wrong = [(prompt, r.usage.completion_tokens, r.timings.attempts) for prompt, _, r in done
             if r.text != reference[prompt, r.usage.completion_tokens]]
    assert not wrong, f"texts unlike the uninterrupted run's (prompt, tokens, attempts): {wrong}"
    assert not dead_owned_live_rows(rows)
    assert not set(kills) & {r.pid for r in rows}

    async def after() -> list[Any]:
        async with AsyncClient(server.address) as client:
            return await asyncio.gather(*(client.generate(p, max_tokens=8, temperature=0, timeout=30)
                                          for p in CHAOS_PROMPTS * 2))

    assert all(r.usage.completion_tokens == 8 for r in asyncio.run(after()))
    assert not server.tracebacks(), "\n".join(server.log)


# --- 2. a stopped (hung) worker -----------------------------------------------------------------

STALL_TIMEOUT_S = 2.0
RUNS = 5  # of a scene whose request ended before its instance was caught running it, at most


def _caught_running(server: Any, total: int, request: Callable[[], None], outcome: dict[str, Any]
                    ) -> tuple[threading.Thread, SlotRow]:
    """``request`` (of ``total`` tokens) run in a thread until its instance is caught running it far from its end
    and left stopped there (``caught_mid_request``): the thread, and the instance's row. Run again where it ended
    first (it filled ``outcome``)."""
    for _ in range(RUNS):
        outcome.clear()
        t = threading.Thread(target=request)
        t.start()
        row = caught_mid_request(server.slots, total, lambda: bool(outcome))
        if row is not None:
            return t, row
        t.join()
    pytest.fail(f"in each of {RUNS} runs the request ended before its instance was caught running it")


@pytest.mark.timeout(90)
def test_a_stopped_worker_is_replaced_and_its_request_runs_again_on_the_replacement(start_server) -> None:
    server = start_server("--instances", "1", "--threads", "1", "--n-ctx", "8192",
                          "--stall-timeout", str(STALL_TIMEOUT_S)).wait_ready()
    stopped_pid = 0
    outcome: dict[str, Any] = {}
    try:
        with Client(server.address) as client:
            def long_request() -> None:
                try:
                    outcome["result"] = client.generate("stall", max_tokens=300, temperature=0, timeout=60)
                except MpserveError as exc:
                    outcome["error"] = exc
                outcome["at"] = time.monotonic()

            t, row = _caught_running(server, 300, long_request, outcome)
            stopped_pid = row.pid
            stopped_at = time.monotonic()
            t.join(STALL_TIMEOUT_S + 30)
            assert not t.is_alive(), "the request of a stopped worker never ended:\n" + "\n".join(server.log)
            result = outcome.get("result")
            assert result is not None and result.usage.completion_tokens == 300, outcome
            assert result.timings.attempts == 2  # nothing was streamed: it ran again from its prompt
            took = outcome["at"] - stopped_at
            print(f"\nhang: request of the SIGSTOPped worker (pid {stopped_pid}) done on its replacement "
                  f"{took:.2f} s after the stop (stall timeout {STALL_TIMEOUT_S} s)")

            result = client.generate("after", max_tokens=16, temperature=0, timeout=60)
            assert result.usage.completion_tokens == 16
            row = server.slots()[0]
            assert row.pid != stopped_pid and running(row.pid), "the next request was not served by a replacement"
        assert not server.tracebacks(), "\n".join(server.log)
    finally:
        if stopped_pid and process_state(stopped_pid) == "T":
            os.kill(stopped_pid, signal.SIGKILL)
            os.kill(stopped_pid, signal.SIGCONT)


# --- 4. a client that never reads ---------------------------------------------------------------

NON_READER_REQUESTS = 1000
MAX_PENDING_PER_CLIENT = ServerConfig.max_pending_per_client
OTHERS_DEADLINE_S = 30.0


@pytest.mark.timeout(120)
def test_a_client_that_never_reads_does_not_hold_up_other_clients(start_server) -> None:
    """A client sends 1,000 streamed requests and reads nothing: the broker takes as many as one client may
    have pending (max_pending_per_client, by default) and refuses the rest, busy, each refusal naming that
    bound (read at the end); another client's requests, sent once each, are neither refused nor lost."""
    server = start_server("--instances", "2").wait_ready()
    with dealer(server.address, RCVHWM=4, SNDHWM=NON_READER_REQUESTS + 10) as hog, Client(server.address) as client:
        for i in range(NON_READER_REQUESTS):
            hog.send_multipart(raw_request({"id": f"hog{i}", "prompt": "never read", "stream": True,
                                            "params": {"max_tokens": 200, "temperature": 0}}))
        counters = wait_for(lambda: (c := client.stats().counters).get("accepted", 0) + c.get("rejected_busy", 0)
                            == NON_READER_REQUESTS and c, 30, "the broker to answer all of the non-reader's requests")
        taken = counters["accepted"]  # a request that ended meanwhile left room for one more
        assert MAX_PENDING_PER_CLIENT <= taken <= MAX_PENDING_PER_CLIENT + counters.get("done", 0), counters

        async def others() -> list[float]:
            """20 requests of a well-behaved client, each sent once: none may be refused or lost."""
            async with AsyncClient(server.address) as other:
                async def timed(i: int) -> float:
                    started = time.monotonic()
                    if i % 2:
                        result = await other.generate(f"other {i}", max_tokens=16, temperature=0,
                                                      timeout=OTHERS_DEADLINE_S)
                    else:
                        s = other.stream(f"other {i}", max_tokens=16, temperature=0, timeout=OTHERS_DEADLINE_S)
                        assert "".join([t async for t in s]) and s.result is not None
                        result = s.result
                    assert result.usage.completion_tokens == 16
                    return time.monotonic() - started

                return await asyncio.gather(*(timed(i) for i in range(20)))

        started = time.monotonic()
        latencies = asyncio.run(others())
        total_s = time.monotonic() - started

        def drained() -> Any:  # the broker holds nothing more of the non-reader's, which has not read a byte
            stats = client.stats()
            return stats if stats.models["tiny"].queued == stats.models["tiny"].running == 0 else None

        stats = wait_for(drained, 10, "the non-reader's requests dropped")
        dropped = {k: v for k, v in stats.counters.items() if k.startswith(("client_", "cancelled"))}
        print(f"\nnon-reading client: it sent {NON_READER_REQUESTS} streamed requests (200 tokens each) and "
              f"never read; {taken} taken; 20 requests of another client completed in {total_s:.2f} s (slowest "
              f"{max(latencies):.2f} s); broker counters {dropped}, done {stats.counters.get('done')}")
        assert server.proc.poll() is None
        assert client.generate("still fine", max_tokens=4, temperature=0, timeout=30).usage.completion_tokens == 4
        errors = []
        while hog.poll(1000):  # what it was sent, if it had read
            if isinstance(message := wire.decode(hog.recv_multipart()), wire.Error):
                errors.append(message)
    refusals = [e for e in errors if e.code == "busy"]
    assert len(refusals) == NON_READER_REQUESTS - taken, collections.Counter(e.code for e in errors)
    assert all(f"you have {MAX_PENDING_PER_CLIENT} requests pending" in e.message and e.retry_after
               for e in refusals), refusals[0]
    assert not server.tracebacks(), "\n".join(server.log)


# --- 5. the broker is SIGKILLed -----------------------------------------------------------------

@pytest.mark.timeout(90)
def test_after_the_broker_is_killed_its_workers_exit_with_adopt_wait_0_and_the_name_can_be_reused(start_server
                                                                                                     ) -> None:
    server = start_server("--instances", "2", "--adopt-wait", "0").wait_ready()  # the default: test_adoption
    info = server.info
    worker_pids = [r.pid for r in server.slots()]
    helpers = children(server.proc.pid)  # the fork server the workers came from, multiprocessing's tracker
    assert all(running(p) for p in worker_pids) and helpers
    assert not set(worker_pids) & set(helpers), "workers are forked from the fork server, not the server"
    server.proc.kill()
    killed_at = time.monotonic()
    wait_for(lambda: not any(running(p) for p in worker_pids + helpers), 10,
             f"workers {worker_pids} and helpers {helpers} gone after the broker was killed (not reaped yet)")
    gone_s = time.monotonic() - killed_at
    server.proc.wait(10)
    stale = [Path(info.slots), Path(info.front[len("ipc://"):])]
    assert all(p.exists() for p in stale), "the killed broker left nothing behind; the test proves nothing"

    again = start_server("--instances", "2", name=server.name).wait_ready()
    with Client(again.address) as client:
        assert client.generate("again", max_tokens=8, temperature=0, timeout=30).usage.completion_tokens == 8
    assert again.info.pid == again.proc.pid
    assert any("no longer running" in line for line in again.log)
    print(f"\nbroker kill: both workers (pids {worker_pids}) gone {gone_s:.2f} s after the broker's SIGKILL; "
          f"a new server of the same name started and served")
    assert not again.tracebacks(), "\n".join(again.log)


# --- 6. a model that cannot load ----------------------------------------------------------------

@pytest.mark.timeout(90)
def test_a_model_that_cannot_load_fails_requests_with_the_load_error_and_does_not_restart_loop(
        start_server, tmp_path: Path, tiny_model_path: str) -> None:
    bad = tmp_path / "cut.gguf"  # the tiny model cut short in its tensor data: start's checks read its header,
    whole = Path(tiny_model_path).read_bytes()  # and llama.cpp's loader refuses it
    bad.write_bytes(whole[:len(whole) * 9 // 10])
    with pytest.raises(Exception) as direct:  # the error llama.cpp gives for this file, loaded directly
        llama_cpp.Llama(model_path=str(bad), verbose=False)
    load_error = str(direct.value)

    server = start_server("--model", str(bad), "--log-level", "debug")
    wait_for(lambda: server.proc.poll() is not None or published(server.name), 30, "the server's slot table")
    assert server.proc.poll() is None, "\n".join(server.log)

    def request() -> MpserveError:
        with Client(server.address) as client:
            with pytest.raises(ModelFailed) as err:
                client.generate("hi", max_tokens=4, timeout=30)
        return err.value

    first = request()  # queued while the instance keeps failing to load, or refused once it is failed
    assert load_error in first.message, first.message
    row = wait_for(lambda: (r := server.slots()[0]).state is SlotState.FAILED and r, 30, "the row failed")

    # No restart loop: over a window longer than the next restart backoff would be, no worker is started.
    starts = sum("started worker" in line for line in server.log)
    window_end = time.monotonic() + 4.0
    while time.monotonic() < window_end:
        now = server.slots()[0]
        assert now.state is SlotState.FAILED and not running(now.pid), now
        time.sleep(0.1)
    assert sum("started worker" in line for line in server.log) == starts
    assert server.proc.poll() is None

    second = request()
    assert load_error in second.message, second.message
    status = mpserve("status", "--json", "--server-name", server.name, timeout=30)
    assert status.returncode == 0, status.stderr
    assert [s["state"] for s in json.loads(status.stdout)["slots"]] == ["failed"]
    print(f"\nmodel that cannot load: {starts} worker start(s), then failed; requests got model_failed: "
          f"{second.message}")
    assert row.state is SlotState.FAILED
    assert not server.tracebacks(), "\n".join(server.log)


# --- 7. a client that disappears ----------------------------------------------------------------

CLIENT_EXPIRY_S = 5.0
VANISHING_CLIENT = """
import sys
from mpserve import Client

with Client(sys.argv[1]) as client:
    client.generate("vanish", max_tokens=8000, temperature=0)
"""


def _expire_while_stopped(server: Any, observer: Client, gone: Callable[[], object]) -> None:
    """``gone()`` (the client goes silent) with the server's instance stopped (SIGSTOP) in the middle of the
    client's request of 8000 tokens; the instance goes on once the broker has expired the client (its CANCEL then
    waits on the worker's link). So the request is cancelled before its end for certain, on a host of any speed."""
    row = caught_mid_request(server.slots, 8000, lambda: False)
    assert row is not None
    try:
        gone()
        wait_for(lambda: observer.stats().counters.get("client_expired"), CLIENT_EXPIRY_S + 10,
                 "the broker to expire the silent client")
    finally:
        os.kill(row.pid, signal.SIGCONT)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["process_killed", "socket_closed"])
def test_the_request_of_a_client_that_disappears_is_cancelled(start_server, how: str) -> None:
    server = start_server("--instances", "1", "--threads", "1", "--n-ctx", "8192",
                          "--client-timeout", str(CLIENT_EXPIRY_S)).wait_ready()
    with contextlib.ExitStack() as stack:
        if how == "process_killed":
            proc = subprocess.Popen([sys.executable, "-c", VANISHING_CLIENT, server.address])
            stack.callback(lambda: proc.poll() is None and (proc.kill(), proc.wait()))
            gone = proc.kill
        else:
            sock = stack.enter_context(dealer(server.address))
            sock.send_multipart(raw_request({"id": "vanish", "prompt": "vanish",
                                             "params": {"max_tokens": 8000, "temperature": 0}}))
            gone = sock.close
        observer = stack.enter_context(Client(server.address))
        _expire_while_stopped(server, observer, gone)
        gone_at = time.monotonic()
        row = wait_for(lambda: (r := server.slots()[0]).state is SlotState.IDLE and r, 30,
                       "the instance idle again after its client disappeared")
        took = time.monotonic() - gone_at
        print(f"\nvanished client ({how}): its request was stopped after {row.tokens} of 8000 tokens, "
              f"{took:.2f} s after the broker expired its client")
        assert row.tokens < 8000
        with Client(server.address) as client:
            assert client.generate("next", max_tokens=4, temperature=0, timeout=30).usage.completion_tokens == 4
        assert not server.tracebacks(), "\n".join(server.log)


@pytest.mark.timeout(90)
def test_a_silent_client_that_comes_back_reads_an_error_for_each_request_cancelled(start_server) -> None:
    """A client the broker expired may only have stalled (a gateway busy for longer than the expiry): each of
    its requests is answered with an ERROR, so that it ends them when it reads again, instead of waiting for
    good."""
    server = start_server("--instances", "1", "--threads", "1", "--n-ctx", "8192",
                          "--client-timeout", str(CLIENT_EXPIRY_S)).wait_ready()
    with dealer(server.address) as sock:
        for rid in ("stalled-1", "stalled-2"):  # the first runs, the second waits in the queue
            sock.send_multipart(raw_request({"id": rid, "prompt": rid,
                                             "params": {"max_tokens": 8000, "temperature": 0}}))
        with Client(server.address) as observer:
            _expire_while_stopped(server, observer, lambda: None)
        wait_for(lambda: server.slots()[0].state is SlotState.IDLE, 30,
                 "the instance idle again once the silent client expired")
        errors = {}
        while len(errors) < 2:
            message = received(sock, 10)
            if isinstance(message, wire.Error):
                errors[message.id] = message
        assert set(errors) == {"stalled-1", "stalled-2"}
        assert all(e.code == "cancelled" and "sent nothing for 5 s" in e.message for e in errors.values()), errors
    assert not server.tracebacks(), "\n".join(server.log)


@pytest.mark.timeout(90)
def test_a_live_client_keeps_a_request_that_is_silent_for_longer_than_the_expiry(start_server) -> None:
    """The other side of expiry: a client that is still there (its library pings) keeps a non-streamed
    request whose worker says nothing for longer than the broker's client expiry (here: a worker frozen
    with SIGSTOP for the expiry + 2 s, far below the stall timeout)."""
    server = start_server("--instances", "1", "--threads", "1", "--n-ctx", "4096", "--stall-timeout", "60",
                          "--client-timeout", str(CLIENT_EXPIRY_S)).wait_ready()
    frozen = 0
    outcome: dict[str, Any] = {}
    try:
        with Client(server.address) as client, Client(server.address) as observer:
            def patient() -> None:
                try:
                    outcome["result"] = client.generate("patience", max_tokens=1000, temperature=0, timeout=80)
                except MpserveError as exc:
                    outcome["error"] = exc

            t, row = _caught_running(server, 1000, patient, outcome)
            frozen = row.pid
            hold_until = time.monotonic() + CLIENT_EXPIRY_S + 2
            while time.monotonic() < hold_until:  # the request stays running the whole time
                assert observer.stats().models["tiny"].running == 1, "the live client's request was dropped"
                time.sleep(0.2)
            os.kill(frozen, signal.SIGCONT)
            t.join(60)
        assert "error" not in outcome, outcome
        assert outcome["result"].usage.completion_tokens == 1000
        assert not server.tracebacks(), "\n".join(server.log)
    finally:
        if frozen and process_state(frozen) == "T":
            os.kill(frozen, signal.SIGCONT)


# --- 8. idle unload -----------------------------------------------------------------------------

@pytest.mark.timeout(90)
def test_an_idle_instance_unloads_and_the_next_request_reloads_it(start_server) -> None:
    server = start_server("--instances", "1", "--threads", "1", "--idle-timeout", "1").wait_ready()
    with Client(server.address) as client:
        first = client.generate("idle", max_tokens=8, temperature=0, timeout=30)
        wait_for(lambda: server.slots()[0].state is SlotState.UNLOADED, 1 + 5, "the idle row unloaded")
        second = client.generate("idle", max_tokens=8, temperature=0, timeout=60)
        row = server.slots()[0]
    assert second.text == first.text and second.usage.completion_tokens == 8
    assert row.state in SERVING and running(row.pid), row
    assert not server.tracebacks(), "\n".join(server.log)
