"""The server dies under load and comes back (``mpserve.server.adoption``): its instances outlive it, holding their
requests; the next server of the same name adopts them (no model loaded again), and the clients, silent for a
moment, reattach: every stream finishes with the text of an uninterrupted run, none of it twice. Without a server
back within their bounds, the clients fail ``connection`` and the instances exit, as before."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from conftest import ServerProcess
from helpers import children, free_port, http_up, mpserve, wait_for

from mpserve import Client
from mpserve.client import PING_INTERVAL_S, PING_LIVENESS
from mpserve.errors import ConnectionFailed
from mpserve.runtime import runtime_dir
from mpserve.wire.slots import SlotState

PROMPTS = [f"Once upon a time, {i} " for i in range(8)]
MAX_TOKENS = 600
ARGS = ("--instances", "2", "--parallel", "4", "--n-ctx", "2048")


def _running(pid: int) -> bool:
    try:
        return not open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


def _worker_pids(server) -> list[int]:
    return sorted({r.pid for r in server.slots() if r.pid})


class _Streamer(threading.Thread):
    """One greedy stream, its chunks timed: the text, the result's, the longest pause between two chunks, or the
    error that ended it."""

    def __init__(self, address: str, prompt: str, reattach: float = 30.0, max_tokens: int = MAX_TOKENS) -> None:
        super().__init__()
        self.address, self.prompt, self.reattach, self.max_tokens = address, prompt, reattach, max_tokens
        self.started = threading.Event()
        self.text = ""
        self.result = ""
        self.pause = 0.0
        self.error: Exception | None = None
        self.id = ""

    def run(self) -> None:
        try:
            with Client(self.address, timeout=120, reattach=self.reattach) as client:
                stream = client.stream(self.prompt, max_tokens=self.max_tokens, temperature=0)
                self.id = stream.id
                last, parts = None, []
                for text in stream:
                    now = time.monotonic()
                    self.pause = max(self.pause, now - last) if last is not None else 0.0
                    last = now
                    parts.append(text)
                    self.started.set()
                self.text = "".join(parts)
                assert stream.result is not None
                self.result = stream.result.text
        except Exception as exc:  # noqa: BLE001 - recorded, asserted by the test
            self.error = exc
            self.started.set()


def _story(streams: list[_Streamer], *servers: ServerProcess) -> str:
    """What the servers logged about the streams that failed, and each one's last lines: why a stream got no
    answer."""
    ids = [s.id for s in streams if s.error is not None and s.id]
    lines = [f"failed: {ids}"]
    for server in servers:
        lines += [f"--- {server.name}, pid {server.proc.pid}: lines naming them", *(
            line for line in server.log if any(i in line for i in ids)), "--- its last lines", *server.log[-30:]]
    return "\n".join(lines)


def _freeze(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        os.kill(pid, sig)


@pytest.mark.timeout(180)
def test_a_server_killed_with_8_streams_and_started_again_5_s_later_finishes_each_exactly_on_its_instance(
        start_server) -> None:
    server = start_server(*ARGS).wait_ready()
    with Client(server.address) as client:
        whole = [client.generate(p, max_tokens=MAX_TOKENS, temperature=0).text for p in PROMPTS]
    pids = _worker_pids(server)
    streams = _streams_frozen_mid_way(server, pids, PROMPTS)
    _kill_frozen(server, pids)
    time.sleep(5)  # not a wait: what a service manager's restart delay does
    again = start_server(*ARGS, name=server.name).wait_ready()
    for s in streams:
        s.join(120)
    assert [s.error for s in streams] == [None] * len(streams), _story(streams, server, again)
    assert [s.text for s in streams] == whole, "a stream's text differs from its uninterrupted run"
    assert [s.result for s in streams] == whole
    wait_for(lambda: _worker_pids(again) == pids, 10, "the adopted instances in the new slot table")
    with Client(again.address) as client:
        counters = client.stats().counters
    assert counters["adopted_requests"] == len(PROMPTS), counters
    assert counters["reattached"] == len(PROMPTS), counters
    assert not any("instances are forked from here" in line for line in again.log), "a model was loaded again"
    pauses = sorted(s.pause for s in streams)
    print(f"\nserver SIGKILLed with {len(streams)} streams, started again 5 s later: all exact on the same instances "
          f"(pids {pids}); longest pause per stream p50 {statistics.median(pauses):.1f} s, max {pauses[-1]:.1f} s")
    again.stop()
    wait_for(lambda: not any(_running(p) for p in pids), 15, "the adopted instances to stop with their server")
    assert not again.tracebacks(), "\n".join(again.log)


def _generating(server) -> int:
    """How many of the server's slots generate a request now (a slot is marked free before its DONE is sent)."""
    return sum(1 for r in server.slots() if r.state == SlotState.BUSY and r.request and r.tokens)


def freeze_generating(server, pids: list[int], streams: int, ended: Callable[[], bool]) -> bool:
    """SIGSTOP the instances ``pids`` as soon as ``streams`` requests generate, read from the slot table (no client,
    pipe or thread between: the window is one poll), and say whether all were still generating once stopped: False
    when one ended first (``ended()`` said so, or its slot was free), however unlikely, so the caller runs its
    streams again rather than killing a server with nothing left to adopt."""
    while _generating(server) < streams and not ended():
        time.sleep(0.001)
    _freeze(pids, signal.SIGSTOP)
    if _generating(server) == streams and not ended():
        return True
    _freeze(pids, signal.SIGCONT)
    return False


def _streams_frozen_mid_way(server, pids: list[int], prompts: list[str], reattach: float = 30.0,
                            max_tokens: int = MAX_TOKENS) -> list[_Streamer]:
    """A _Streamer of each prompt, their instances stopped while every one generates (run again where one ended
    before the stop could come)."""
    for _ in range(3):
        streams = [_Streamer(server.address, p, reattach, max_tokens) for p in prompts]
        for s in streams:
            s.start()
        if freeze_generating(server, pids, len(prompts), lambda ss=streams: any(not s.is_alive() for s in ss)):
            return streams
        for s in streams:
            s.join(120)
    pytest.fail("three times, a stream ended before its instance could be stopped")


def _kill_frozen(server, pids: list[int]) -> None:
    """SIGKILL the server while its instances are stopped (so that nothing ends meanwhile, however fast the model)."""
    _freeze(pids, signal.SIGSTOP)
    server.proc.kill()
    server.proc.wait(10)
    _freeze(pids, signal.SIGCONT)


def _queued(server) -> int:
    with Client(server.address) as client:
        return sum(m.queued for m in client.stats().models.values())


def _counters(server) -> dict[str, int]:
    with Client(server.address) as client:
        return dict(client.stats().counters)


@pytest.mark.timeout(180)
def test_a_server_killed_again_after_it_adopted_its_instances_has_them_adopted_again_with_their_requests(
        start_server) -> None:
    """What one adoption took on (its requests resumed from their parked sequences) the next adopts again, rather
    than running them anew: a server restarted over and over (a crash loop) costs its streams pauses only."""
    server = start_server(*ARGS).wait_ready()
    prompts, tokens = PROMPTS[:4], 1200
    with Client(server.address) as client:
        whole = [client.generate(p, max_tokens=tokens, temperature=0).text for p in prompts]
    pids = _worker_pids(server)
    streams = _streams_frozen_mid_way(server, pids, prompts, max_tokens=tokens)
    _kill_frozen(server, pids)
    second = start_server(*ARGS, name=server.name).wait_ready()
    wait_for(lambda: _counters(second).get("reattached") == len(prompts), 30, "the streams reattached")
    wait_for(lambda: _worker_pids(second) == pids, 10, "the adopted instances in the new slot table")
    _kill_frozen(second, pids)
    third = start_server(*ARGS, name=server.name).wait_ready()
    for s in streams:
        s.join(120)
    assert [s.error for s in streams] == [None] * len(streams)
    assert [s.text for s in streams] == whole
    counters = _counters(third)
    assert counters.get("adopted_requests") == len(prompts) == counters.get("reattached"), counters
    assert not third.tracebacks(), "\n".join(third.log)


@pytest.mark.timeout(90)
def test_without_a_server_back_the_streams_fail_connection_after_their_reattach_bound_and_the_instances_exit(
        start_server) -> None:
    server = start_server(*ARGS, "--adopt-wait", "3").wait_ready()
    pids = _worker_pids(server)
    streams = _streams_frozen_mid_way(server, pids, PROMPTS[:2], reattach=2.0)
    server.proc.kill()
    killed = time.monotonic()
    server.proc.wait(10)
    _freeze(pids, signal.SIGCONT)
    bound = PING_INTERVAL_S * PING_LIVENESS + 2.0 + 5.0  # the silence that tells the server gone, the bound, slack
    for s in streams:
        s.join(max(0.0, killed + bound - time.monotonic()))
    failed_s = time.monotonic() - killed
    assert not any(s.is_alive() for s in streams), (
        f"the streams still waited {failed_s:.1f} s after their server was killed: a reattach bound of 2 s ends them "
        f"once the server has been silent {PING_INTERVAL_S * PING_LIVENESS:g} s and then 2 s more")
    assert all(isinstance(s.error, ConnectionFailed) for s in streams), [s.error for s in streams]
    wait_for(lambda: not any(_running(p) for p in pids), 15, "the instances to exit once their adoption wait is over")
    Path(server.info.slots).unlink()  # what the next start of the name would remove (none comes)
    print(f"\nno server back: the streams failed connection {failed_s:.1f} s after the kill (reattach bound 2 s); "
          "the instances exited after their 3 s adoption wait")


@pytest.mark.timeout(90)
def test_with_adopt_wait_0_the_instances_exit_with_their_server_and_the_next_one_loads_its_own(start_server) -> None:
    server = start_server("--instances", "2", "--adopt-wait", "0").wait_ready()
    pids = _worker_pids(server)
    server.proc.kill()
    server.proc.wait(10)
    wait_for(lambda: not any(_running(p) for p in pids), 10, "the instances to exit with their server")
    again = start_server("--instances", "2", name=server.name).wait_ready()
    assert not set(_worker_pids(again)) & set(pids)
    assert not again.tracebacks(), "\n".join(again.log)


@pytest.mark.timeout(180)
def test_an_instance_lost_while_the_server_was_down_is_forked_by_the_adopted_zygote_without_loading_the_model(
        start_server) -> None:
    server = start_server("--instances", "2").wait_ready()
    with Client(server.address) as client:
        before = client.generate("Hello there", max_tokens=16, temperature=0).text
    pids = _worker_pids(server)
    server.proc.kill()
    server.proc.wait(10)
    os.kill(pids[0], signal.SIGKILL)  # the next start must start this one again
    again = start_server("--instances", "2", name=server.name).wait_ready()
    wait_for(lambda: len(_worker_pids(again)) == 2 and pids[0] not in _worker_pids(again), 60,
             "the lost instance started again")
    adopted = [line for line in again.log if "outlived the server before this one; adopted" in line]
    assert adopted, "\n".join(again.log)
    zygote = int(re.search(r"zygote \(pid (\d+)\)", adopted[0]).group(1))  # type: ignore[union-attr]
    assert not any("instances are forked from here" in line for line in again.log), "a model was loaded again"
    with Client(again.address) as client:  # the text of the first start, from either instance
        assert [client.generate("Hello there", max_tokens=16, temperature=0).text for _ in range(4)] == [before] * 4
    again.stop()
    wait_for(lambda: not _running(zygote), 15, "the adopted zygote to stop with its server")
    assert not again.tracebacks(), "\n".join(again.log)


@pytest.mark.timeout(180)
def test_streams_whose_instance_died_with_the_server_go_on_from_the_journal_and_a_queued_one_runs_once(
        start_server) -> None:
    """The server and its one instance SIGKILLed, two streams generating and one queued: nothing is left to adopt,
    but the next start finds the three in the dead server's journal. The two go on from the tokens they had streamed,
    the queued one starts; none is accepted anew, and each text is its uninterrupted run's (``reuse: exact``: the
    carried tokens decoded one a step)."""
    args = ("--instances", "1", "--parallel", "2", "--reuse", "exact")
    server = start_server(*args).wait_ready()
    prompts = PROMPTS[:3]
    with Client(server.address) as client:
        whole = [client.generate(p, max_tokens=MAX_TOKENS, temperature=0).text for p in prompts]
    pids = _worker_pids(server)
    for _ in range(3):
        streams = [_Streamer(server.address, p) for p in prompts]
        for s in streams:
            s.start()
        if freeze_generating(server, pids, 2, lambda ss=streams: any(not s.is_alive() for s in ss)):
            break
        for s in streams:
            s.join(120)
    wait_for(lambda: _queued(server) == 1, 10, "the third stream queued")
    server.proc.kill()
    server.proc.wait(10)
    _freeze(pids, signal.SIGKILL)
    again = start_server(*args, name=server.name).wait_ready()
    for s in streams:
        s.join(120)
    assert [s.error for s in streams] == [None] * len(streams), _story(streams, server, again)
    assert [s.text for s in streams] == whole, "a stream's text differs from its uninterrupted run"
    counters = _counters(again)
    assert (counters.get("journaled_requests"), counters.get("reattached"), counters.get("accepted")) == (3, 3, None), \
        counters
    assert not again.tracebacks(), "\n".join(again.log)


def _served(server) -> int:
    """The requests the server's one instance finished (each row has the count as it was when its slot last ended)."""
    return max(r.served for r in server.slots() if r.pid)


class _Plain(threading.Thread):
    """One greedy request, not streamed: its text, or the error that ended it."""

    def __init__(self, address: str, prompt: str, max_tokens: int) -> None:
        super().__init__()
        self.address, self.prompt, self.max_tokens = address, prompt, max_tokens
        self.text = ""
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            with Client(self.address, timeout=120, reattach=30.0) as client:
                self.text = client.generate(self.prompt, max_tokens=self.max_tokens, temperature=0).text
        except Exception as exc:  # noqa: BLE001 - recorded, asserted by the test
            self.error = exc


def _assigned(server) -> int:
    """The requests the broker has given a slot."""
    with Client(server.address) as client:
        return sum(m.running for m in client.stats().models.values())


def _both_generating_then_stopped(server, pids: list[int], prompts: list[str], tokens: int
                                  ) -> tuple[_Streamer, _Plain]:
    """A stream of prompts[0] and a plain request of prompts[1], both generating on the server's one instance, and
    the instance stopped. The instance is stopped once the stream generates, until the broker has given the plain
    request the other slot: neither can end before the other began, however loaded the host (run again where one
    ended before the last stop could come)."""
    for _ in range(3):
        stream = _Streamer(server.address, prompts[0], max_tokens=tokens)
        stream.start()
        if not freeze_generating(server, pids, 1, lambda s=stream: not s.is_alive()):
            stream.join(120)
            continue
        plain = _Plain(server.address, prompts[1], tokens)
        plain.start()
        wait_for(lambda: _assigned(server) == 2, 30, "the plain request given the stopped instance's other slot")
        _freeze(pids, signal.SIGCONT)
        if freeze_generating(server, pids, 2, lambda s=stream, p=plain: not (s.is_alive() and p.is_alive())):
            return stream, plain
        stream.join(120)
        plain.join(120)
    pytest.fail("three times, a request ended before its instance could be stopped")


@pytest.mark.timeout(180)
def test_requests_that_ended_as_their_server_died_are_answered_by_the_next_start_without_computing_them_again(
        start_server) -> None:
    """A stream and a plain request end while their server is stopped (SIGSTOP: their answers wait unread in its
    socket), and the server is SIGKILLed. The next start learns the answers from the instance that sent them (its
    READY), and the clients, reattaching, get them whole: nothing is computed again (the instance's count of
    requests served stays), nothing is run from the dead server's journal."""
    args = ("--instances", "1", "--parallel", "2")
    server = start_server(*args).wait_ready()
    prompts, tokens = PROMPTS[:2], 1000
    with Client(server.address) as client:
        whole = [client.generate(p, max_tokens=tokens, temperature=0).text for p in prompts]
    pids = _worker_pids(server)
    stream, plain = _both_generating_then_stopped(server, pids, prompts, tokens)
    served = _served(server)
    server.proc.send_signal(signal.SIGSTOP)
    _freeze(pids, signal.SIGCONT)
    wait_for(lambda: _served(server) == served + 2, 60, "both requests to end on their instance")
    server.proc.kill()
    server.proc.wait(10)
    again = start_server(*args, name=server.name).wait_ready()
    stream.join(120)
    plain.join(120)
    assert (stream.error, plain.error) == (None, None), _story([stream], server, again)
    assert [stream.text, plain.text] == whole
    wait_for(lambda: _worker_pids(again) == pids, 10, "the adopted instance in the new slot table")
    assert _served(again) == served + 2, "a request was computed again"
    counters = _counters(again)
    assert (counters.get("adopted_answers"), counters.get("reattached"), counters.get("accepted")) == (2, 2, None), \
        counters
    assert not again.tracebacks(), "\n".join(again.log)


@pytest.mark.timeout(180)
def test_a_start_with_other_settings_adopts_the_zygote_and_rolls_its_instances_but_not_one_of_other_weights(
        start_server, tiny_model_path: str, tmp_path: Path) -> None:
    server = start_server("--instances", "1", "--n-ctx", "512", "--name", "tiny").wait_ready()
    pids = _worker_pids(server)
    server.proc.kill()
    server.proc.wait(10)
    again = start_server("--instances", "1", "--n-ctx", "1024", "--name", "tiny", name=server.name).wait_ready()
    assert any("zygote (pid" in line and "adopted" in line for line in again.log), "\n".join(again.log)
    # its instance, adopted, runs the n_ctx before: rolled onto this start's, forked from the same weights
    wait_for(lambda: [(r.pid not in pids, r.kv_capacity) for r in again.slots() if r.pid] == [(True, 1024)], 30,
             "the adopted instance replaced by one of this start's settings")
    assert any("instances of other settings than this start's were adopted" in line for line in again.log)
    assert not any("instances are forked from here" in line for line in again.log)  # another context, same weights

    pids = _worker_pids(again)
    again.proc.kill()
    again.proc.wait(10)
    os.kill(pids[0], signal.SIGKILL)
    other = tmp_path / "other.gguf"  # the same bytes, another file: other weights as far as a zygote can tell
    other.write_bytes(Path(tiny_model_path).read_bytes())
    third = start_server("--instances", "1", "--model", str(other), "--name", "tiny", name=server.name).wait_ready()
    refused = [line for line in third.log if "loaded the model otherwise; stopping it" in line]
    assert refused, "\n".join(third.log)
    zygote = int(re.search(r"zygote \(pid (\d+)\)", refused[0]).group(1))  # type: ignore[union-attr]
    wait_for(lambda: not _running(zygote), 15, "the refused zygote to stop")
    assert any("instances are forked from here" in line for line in third.log)  # its own zygote loaded the model
    assert not third.tracebacks(), "\n".join(third.log)


def _http_stream(url: str, prompt: str, out: dict[str, object], started: threading.Event) -> None:
    """A greedy completion streamed over HTTP: its text, or what ended it."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    parts: list[str] = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out["error"] = event["error"]
                    return
                parts.append(event["choices"][0]["text"])
                started.set()
        out["text"] = "".join(parts)
    except httpx.HTTPError as exc:
        out["error"] = exc
    finally:
        started.set()


def _http_streams(url: str, prompts: list[str]) -> tuple[list[dict[str, object]], list[threading.Thread]]:
    """A thread streaming each prompt over HTTP (``_http_stream``), once each has its first text: what each gets
    (filled in when its thread ends), and the threads."""
    outs: list[dict[str, object]] = [{} for _ in prompts]
    started = [threading.Event() for _ in prompts]
    threads = [threading.Thread(target=_http_stream, args=(url, p, o, e))
               for p, o, e in zip(prompts, outs, started, strict=True)]
    for t in threads:
        t.start()
    assert all(e.wait(60) for e in started)
    return outs, threads


@pytest.mark.timeout(180)
def test_http_streams_through_a_gateway_of_its_own_go_on_over_the_servers_death(start_server) -> None:
    """``mpserve gateway --http-workers 2``, a service of its own (its processes exit with their parent, not with the
    server): its streams wait for the server to come back and go on exactly."""
    server = start_server(*ARGS).wait_ready()
    prompts = PROMPTS[:4]
    with Client(server.address) as client:
        whole = [client.generate(p, max_tokens=MAX_TOKENS, temperature=0).text for p in prompts]
    pids = _worker_pids(server)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    gateway = subprocess.Popen([sys.executable, "-m", "mpserve", "gateway", "--server-name", server.name, "--http",
                                f"127.0.0.1:{port}", "--http-workers", "2"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: http_up(url), 30, "the gateway answers")
        outs, threads = _http_streams(url, prompts)
        _kill_frozen(server, pids)
        time.sleep(2)  # not a wait: a service manager's restart delay
        start_server(*ARGS, name=server.name).wait_ready()
        for t in threads:
            t.join(120)
        assert [o.get("text") for o in outs] == whole, outs
    finally:
        gateway.terminate()
        gateway.wait(30)


@pytest.mark.timeout(180)
def test_http_streams_through_the_gateways_of_start_http_go_on_over_the_servers_death(start_server) -> None:
    """``mpserve start --http --http-workers 2`` (the gateways are the server's children): killed, its gateways let
    the port go for the next start's and finish their streams on that start; each streams exactly."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = (*ARGS, "--http", f"127.0.0.1:{port}", "--http-workers", "2")
    server = start_server(*args).wait_ready()
    prompts = PROMPTS[:4]
    with Client(server.address) as client:
        whole = [client.generate(p, max_tokens=MAX_TOKENS, temperature=0).text for p in prompts]
    wait_for(lambda: http_up(url), 30, "the gateway answers")
    outs, threads = _http_streams(url, prompts)
    _kill_frozen(server, _worker_pids(server))
    time.sleep(2)  # not a wait: a service manager's restart delay
    again = start_server(*args, name=server.name).wait_ready()
    for t in threads:
        t.join(120)
    assert [o.get("text") for o in outs] == whole, outs
    wait_for(lambda: http_up(url), 30, "the next start's gateways answer")
    with httpx.Client(timeout=60) as http:
        answer = http.post(url + "/v1/completions", json={"prompt": prompts[0], "max_tokens": 16, "temperature": 0})
    assert answer.status_code == 200 and whole[0].startswith(answer.json()["choices"][0]["text"])
    assert not again.tracebacks(), "\n".join(again.log)


def _curve_http(tmp_path: Path) -> tuple[tuple[str, ...], dict[str, str], str]:
    """``start --http`` on a CURVE ``--bind`` (its gateways reattach within 10 s, or fail): its arguments, a client's
    keys for the front, and the gateways' URL."""
    keys, clients = tmp_path / "keys", tmp_path / "clients"
    for name in ("server", "alice"):
        assert mpserve("keygen", str(keys), name).returncode == 0
    clients.mkdir()
    shutil.copy(keys / "alice.key", clients)
    port = free_port()
    args = ("--instances", "2", "--parallel", "2", "--n-ctx", "1024", "--bind", f"tcp://127.0.0.1:{free_port()}",
            "--curve-secret", str(keys / "server.key_secret"), "--curve-clients", str(clients), "--http",
            f"127.0.0.1:{port}", "--reattach", "10")
    curve = {"curve_server_key": str(keys / "server.key"), "curve_secret": str(keys / "alice.key_secret")}
    return args, curve, f"http://127.0.0.1:{port}"


def _curve_http_server(start_server, tmp_path: Path) -> tuple[tuple[str, ...], str, ServerProcess, list[str],
                                                              list[str]]:
    """A ``start --http`` server on a CURVE front (``_curve_http``), its gateway answering: its arguments, the
    gateways' URL, the server, two prompts and their greedy texts."""
    args, curve, url = _curve_http(tmp_path)
    server = start_server(*args).wait_ready()
    prompts = PROMPTS[:2]
    with Client(server.address, **curve) as client:
        whole = [client.generate(p, max_tokens=MAX_TOKENS, temperature=0).text for p in prompts]
    wait_for(lambda: http_up(url), 30, "the gateway answers")
    return args, url, server, prompts, whole


def _join_curve_streams(threads: list[threading.Thread], log: list[str]) -> None:
    """Wait for the HTTP streams, 30 s at most; none of their gateways was refused by the server (CURVE)."""
    deadline = time.monotonic() + 30
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not [line for line in log if "refused a connection" in line]


@pytest.mark.timeout(90)
def test_http_streams_through_the_gateways_of_start_http_on_a_curve_front_go_on_over_the_servers_death(
        start_server, tmp_path: Path) -> None:
    """``start --http`` on a CURVE ``--bind``: its gateways reach the front with a key pair of their own. Killed, the
    next start keeps that pair (the dead server's gateways hold it), so they reattach and their streams finish."""
    args, url, server, prompts, whole = _curve_http_server(start_server, tmp_path)
    key_file = runtime_dir() / f"{server.name}.gateway.key_secret"
    key = key_file.read_bytes()
    outs, threads = _http_streams(url, prompts)
    _kill_frozen(server, _worker_pids(server))
    again = start_server(*args, name=server.name).wait_ready()
    _join_curve_streams(threads, again.log)
    assert [o.get("text") for o in outs] == whole, outs
    assert key_file.read_bytes() == key  # the pair they hold
    assert again.stop() == 0
    assert not list(runtime_dir().glob(f"{server.name}.gateway.key*"))  # a clean stop ends it
    assert not again.tracebacks(), "\n".join(again.log)


@pytest.mark.timeout(90)
def test_an_upgrade_of_start_http_on_a_curve_front_hands_its_gateways_key_pair_on(start_server, tmp_path: Path) -> None:
    """``mpserve upgrade`` of ``start --http`` on a CURVE ``--bind``: the next start keeps the pair, so the old
    gateways finish their streams on it, and its own gateways reach it with the same key."""
    _, url, server, prompts, whole = _curve_http_server(start_server, tmp_path)
    old_gateway = next(pid for pid in children(server.proc.pid)
                       if b"gateway" in Path(f"/proc/{pid}/cmdline").read_bytes())
    key_file = runtime_dir() / f"{server.name}.gateway.key_secret"
    key = key_file.read_bytes()
    before = server.info.started
    outs, threads = _http_streams(url, prompts)
    upgraded = subprocess.run([sys.executable, "-m", "mpserve", "upgrade", "--server-name", server.name, "--wait",
                               "30"], capture_output=True, text=True, timeout=60)  # it asks on the ipc admin socket
    assert upgraded.returncode == 0, upgraded.stderr
    wait_for(lambda: sum("ready:" in line for line in server.log) == 2, 30, "the next start")
    assert server.info.started > before
    _join_curve_streams(threads, server.log)
    assert [o.get("text") for o in outs] == whole, outs
    assert key_file.read_bytes() == key
    wait_for(lambda: not _running(old_gateway), 30, "the old gateway to exit")
    with httpx.Client(timeout=60) as http:  # through the next start's own gateway
        answer = http.post(url + "/v1/completions", json={"prompt": prompts[0], "max_tokens": 16, "temperature": 0})
    assert answer.status_code == 200 and whole[0].startswith(answer.json()["choices"][0]["text"]), answer.text
    assert not server.tracebacks(), "\n".join(server.log)


def upgrade_under_streams(server: ServerProcess, whole: list[str], installed: Callable[[], None] = lambda: None
                          ) -> tuple[subprocess.CompletedProcess[str], list[_Streamer]]:
    """``mpserve upgrade`` while a greedy stream of each of PROMPTS runs (``installed`` called before it: a new
    version put in place): it answers, and each stream ends with its uninterrupted run's text (``whole``)."""
    streams = [_Streamer(server.address, p) for p in PROMPTS]
    for s in streams:
        s.start()
    assert all(s.started.wait(60) for s in streams)
    installed()
    upgraded = mpserve("upgrade", "--server-name", server.name, "--wait", "100", timeout=120)  # it says how far
    assert upgraded.returncode == 0, upgraded.stderr
    for s in streams:
        s.join(150)
    assert [s.error for s in streams] == [None] * len(streams)
    assert [s.text for s in streams] == whole and [s.result for s in streams] == whole
    return upgraded, streams


@pytest.mark.timeout(180)
def test_an_upgrade_under_8_streams_fails_none_and_loads_no_model(start_server) -> None:
    """``mpserve upgrade`` (SIGUSR2): the server hands its instances off and starts again in its own process (the
    mpserve installed now: here the same one); the streams go on exactly, on the same instances."""
    server = start_server(*ARGS).wait_ready()
    with Client(server.address) as client:
        whole = [client.generate(p, max_tokens=MAX_TOKENS, temperature=0).text for p in PROMPTS]
    pids, before = _worker_pids(server), server.info
    upgraded, streams = upgrade_under_streams(server, whole)
    assert f"pid {server.proc.pid}" in upgraded.stdout, upgraded.stdout
    after = server.info
    assert after.pid == before.pid and after.started > before.started  # the same process, started again
    wait_for(lambda: _worker_pids(server) == pids, 10, "the handed-off instances in the new slot table")
    # the next start says ready once both instances registered with it; its log comes through a reader thread
    wait_for(lambda: sum("ready:" in line for line in server.log) >= 2, 30, "the next start's ready line")
    assert sum("ready:" in line for line in server.log) == 2
    assert sum("instances are forked from here" in line for line in server.log) == 1, "a model was loaded again"
    print(f"\nupgrade under {len(streams)} streams: none failed, all exact, instances kept (pids {pids}); "
          f"longest pause per stream max {max(s.pause for s in streams):.1f} s")
    assert not server.tracebacks(), "\n".join(server.log)


@pytest.mark.timeout(180)
def test_an_upgrade_of_start_http_keeps_the_port_served_and_its_http_streams_exact(start_server) -> None:
    """``mpserve upgrade`` of ``start --http --http-workers 2``: the next start serves the very listening socket (its
    gateways start on it), the old gateways finish their streams on the next start and exit; no connection to the
    port is refused meanwhile."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(*ARGS, "--http", f"127.0.0.1:{port}", "--http-workers", "2").wait_ready()
    prompts = PROMPTS[:4]
    with Client(server.address) as client:
        whole = [client.generate(p, max_tokens=MAX_TOKENS, temperature=0).text for p in prompts]
    wait_for(lambda: http_up(url), 30, "the gateway answers")
    old_gateways = {pid for pid in children(server.proc.pid)
                    if b"gateway" in Path(f"/proc/{pid}/cmdline").read_bytes()}
    assert len(old_gateways) == 2, old_gateways
    outs, threads = _http_streams(url, prompts)
    refused: list[Exception] = []
    probing = threading.Event()

    def probe() -> None:  # a new connection every 50 ms all along the upgrade
        while not probing.is_set():
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=5):
                    pass
            except OSError as exc:
                refused.append(exc)
            time.sleep(0.05)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        upgraded = subprocess.run([sys.executable, "-m", "mpserve", "upgrade", "--server-name", server.name],
                                  capture_output=True, text=True, timeout=90)
        assert upgraded.returncode == 0, upgraded.stderr
        for t in threads:
            t.join(120)
    finally:
        probing.set()
        prober.join()
    assert [o.get("text") for o in outs] == whole, outs
    assert refused == []
    wait_for(lambda: not any(_running(p) for p in old_gateways), 30, "the old gateways to exit")
    assert not server.tracebacks(), "\n".join(server.log)
