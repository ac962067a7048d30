"""``python -m bench.soak``: one ``mpserve start --http`` under mixed load for a while, checking that nothing
is lost, duplicated or left behind, and watching its memory.

    mpserve start --http (the built-in tiny model, 2 instances, 1 thread each, by default)
      ▲ ZeroMQ lanes: a raw DEALER speaking mpserve.wire.protocol (so every message is seen): streamed and whole
      │   requests, cancels, requests with a short timeout, bad requests; clients that vanish mid-stream
      │   (a DEALER closed after its first chunk: the broker cancels its request once it stops pinging)
      ▲ HTTP lanes (httpx): streamed (server-sent events) and whole completions and chats, bad bodies,
      │   clients that hang up after the first event
      ▲ every --kill-every seconds: SIGKILL of a random busy worker (the supervisor restarts it; its requests
          are handed over)

Invariants (the exit status is 1 if one breaks, with what broke): every ZeroMQ request ends in exactly one
DONE or ERROR and nothing comes after it; every HTTP stream ends in exactly one ``[DONE]`` or error event;
every outcome is one its kind allows (a worker killed from outside hands its requests over, so no request
may end ``poison_request``, which only a crash the request causes earns); at
the end the broker holds no request, every slot is idle, the broker's counters say it ended as many requests
as it accepted (``TERMINAL_COUNTERS``), and the log has no traceback. Reported as well:
requests per front, kind and outcome; latency percentiles of what succeeded; hand-overs; the RSS and open
descriptors of the broker, the workers and the gateway after a warm-up and at the end (workers that were
killed are new processes, so theirs is not a growth). The issue's target: memory growth < 5%, descriptors
flat; reported, not enforced (the allocator keeps what a burst freed).

    python -m bench.soak --minutes 10 [--instances 2] [--kill-every 20] [--model builtin:tiny] [--seed 1]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import os
import random
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgpack
import zmq
import zmq.asyncio

from mpserve.runtime import ServerInfo
from mpserve.wire import protocol as wire
from mpserve.wire.slots import SlotState, SlotTable

from .figures import percentile
from .procs import MpserveServer, children, free_port, wait_http

ZMQ_KINDS = {"stream": 0.35, "whole": 0.25, "cancel": 0.12, "timeout": 0.1, "bad": 0.1, "vanish": 0.08}
HTTP_KINDS = {"stream": 0.35, "whole": 0.3, "chat": 0.15, "bad": 0.1, "hang_up": 0.1}
ALLOWED = {  # outcomes each kind may end with, workers killed or not
    "stream": {"done"}, "whole": {"done"}, "chat": {"done"}, "cancel": {"done", "cancelled"},
    "timeout": {"done", "timeout"}, "bad": {"bad_request", "unknown_model"}, "vanish": {"vanished"},
    "hang_up": {"hung up", "done"},
}
PROMPTS = ("Once upon a time", "The weather today", "In the beginning", "A list of fruits:", "def main():")
# the broker's counters of how the requests it accepted ended: one each
TERMINAL_COUNTERS = ("done", "worker_error", "timeout", "cancelled", "cancelled_client_gone", "poison_request",
                     "worker_lost")
PING_INTERVAL_S = 0.5
REQUEST_LIMIT_S = 120.0  # a request that has not ended after this long is reported as lost


@dataclass
class Tally:
    outcomes: collections.Counter[tuple[str, str, str]] = field(default_factory=collections.Counter)
    latency_s: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    ttft_s: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    handovers: int = 0
    kills: int = 0
    problems: list[str] = field(default_factory=list)

    def record(self, front: str, kind: str, outcome: str, started: float, first: float | None = None) -> None:
        self.outcomes[(front, kind, outcome)] += 1
        if outcome not in ALLOWED[kind]:
            self.problems.append(f"{front} {kind}: ended {outcome!r}")
        if outcome == "done":
            self.latency_s[f"{front} {kind}"].append(time.perf_counter() - started)
            if first is not None:
                self.ttft_s[f"{front} {kind}"].append(first - started)


# --- ZeroMQ: a raw DEALER, so that every message the broker sends is seen --------------------------

class ZmqFront:
    """Requests over one DEALER; a reader task hands each message to its request and counts terminal ones
    per id (exactly one each), and a pinger keeps the client alive for the broker."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, tally: Tally) -> None:
        self.ctx, self.address, self.tally = ctx, address, tally
        self.sock = self._dealer()
        self.inbox: dict[str, asyncio.Queue[Any]] = {}
        self.ended: collections.Counter[str] = collections.Counter()
        self.sent: list[str] = []  # the ids of this socket's requests
        self._ids = (f"z{n}" for n in itertools.count(1))
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._ping())]

    def _dealer(self) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        return sock

    async def _read(self) -> None:
        while True:
            got = wire.decode(await self.sock.recv_multipart())
            for msg in got.chunks if isinstance(got, wire.Chunks) else (got,):  # a step's chunks, together
                self._deliver(msg)

    def _deliver(self, msg: Any) -> None:
        if isinstance(msg, wire.Pong):
            return
        rid = getattr(msg, "id", None)
        if rid is None:
            self.tally.problems.append(f"zmq: a message for no request: {msg}")
            return
        if self.ended[rid]:
            self.tally.problems.append(f"zmq {rid}: {type(msg).__name__} after its end")
        if isinstance(msg, (wire.Done, wire.Error)):
            self.ended[rid] += 1
        if rid in self.inbox:
            self.inbox[rid].put_nowait(msg)

    async def _ping(self) -> None:
        for nonce in itertools.count(1):
            await self.sock.send_multipart(wire.encode(wire.Ping(nonce)))
            await asyncio.sleep(PING_INTERVAL_S)

    async def run(self, kind: str, rng: random.Random) -> None:
        if kind == "vanish":
            return await self._vanish(rng)
        rid = next(self._ids)
        body = _zmq_body(rid, kind, rng)
        self.inbox[rid] = queue = asyncio.Queue()
        self.sent.append(rid)
        started, first = time.perf_counter(), None
        await self.sock.send_multipart([wire.VERSION, bytes([wire.MsgType.REQUEST]), msgpack.packb(body)])
        cancel_at = started + rng.uniform(0.0, 0.3) if kind == "cancel" else None
        outcome = "lost"
        try:
            while True:
                wait = REQUEST_LIMIT_S if cancel_at is None else max(0.0, cancel_at - time.perf_counter())
                try:
                    msg = await asyncio.wait_for(queue.get(), wait)
                except asyncio.TimeoutError:
                    if cancel_at is None:
                        break
                    await self.sock.send_multipart(wire.encode(wire.Cancel(rid)))
                    cancel_at = None
                    continue
                if isinstance(msg, wire.Chunk):
                    first = first or time.perf_counter()
                    continue
                if isinstance(msg, wire.Done):
                    self.tally.handovers += msg.timings.attempts - 1
                outcome = "done" if isinstance(msg, wire.Done) else msg.code
                break
        finally:
            del self.inbox[rid]
        self.tally.record("zmq", kind, outcome, started, first)

    async def _vanish(self, rng: random.Random) -> None:
        """A client that goes away mid-stream without a word: its own DEALER, closed after the first chunk."""
        sock, started = self._dealer(), time.perf_counter()
        try:
            body = _zmq_body(f"v{next(self._ids)}", "stream", rng) | {"params": {"max_tokens": 512}}
            await sock.send_multipart([wire.VERSION, bytes([wire.MsgType.REQUEST]), msgpack.packb(body)])
            msg = wire.decode(await asyncio.wait_for(sock.recv_multipart(), REQUEST_LIMIT_S))
        finally:
            sock.close(0)
        outcome = msg.code if isinstance(msg, wire.Error) else "vanished"
        self.tally.record("zmq", "vanish", outcome, started)

    def not_ended_once(self) -> list[str]:
        """The requests sent that never ended, or ended more than once."""
        return [f"zmq {rid}: ended {self.ended[rid]} times" for rid in self.sent if self.ended[rid] != 1]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.sock.close(0)


def _zmq_body(rid: str, kind: str, rng: random.Random) -> dict[str, Any]:
    params: dict[str, Any] = {"max_tokens": rng.randint(4, 64), "temperature": rng.choice([0.0, 0.8])}
    body: dict[str, Any] = {"id": rid, "prompt": rng.choice(PROMPTS), "params": params,
                            "stream": kind in ("stream", "cancel", "timeout")}
    if kind == "cancel":
        params["max_tokens"] = 512
    elif kind == "timeout":
        params["max_tokens"], body["timeout"] = 512, rng.uniform(0.01, 0.3)
    elif kind == "bad":
        bad = rng.choice([("max_tokens", 0), ("temperature", -1.0), ("top_p", 2.0), ("stop", ["x"] * 99), ("model", 0)])
        if bad[0] == "model":
            body["model"] = "no-such-model"
        else:
            params[bad[0]] = bad[1]
    return body


# --- HTTP ------------------------------------------------------------------------------------------

async def http_request(http: httpx.AsyncClient, kind: str, rng: random.Random, tally: Tally) -> None:
    body: dict[str, Any] = {"max_tokens": rng.randint(4, 64), "temperature": rng.choice([0, 0.8])}
    path = "/v1/chat/completions" if kind == "chat" or rng.random() < 0.2 else "/v1/completions"
    if path == "/v1/completions":
        body["prompt"] = rng.choice(PROMPTS)
    else:
        body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
    streamed = kind in ("stream", "hang_up") or (kind == "chat" and rng.random() < 0.5)
    if kind == "hang_up":
        body["max_tokens"] = 256
    if kind == "bad":
        body[rng.choice(["max_tokens", "temperature", "top_p", "n"])] = rng.choice([-5, "x", [1] * 40])
    started, first = time.perf_counter(), None
    try:
        if not streamed:
            response = await http.post(path, json=body)
            outcome = "done" if response.status_code == 200 else response.json()["error"]["code"]
        else:
            async with http.stream("POST", path, json=body | {"stream": True}) as response:
                if response.status_code != 200:
                    await response.aread()
                    outcome = response.json()["error"]["code"]
                else:
                    outcome, first = await _events(response, kind == "hang_up", path, tally)
    except httpx.HTTPError as exc:
        outcome = f"transport error {type(exc).__name__}"
    tally.record("http", kind, outcome, started, first)


async def _events(response: httpx.Response, hang_up: bool, path: str, tally: Tally) -> tuple[str, float | None]:
    """Read server-sent events: exactly one terminal event ([DONE] or an error), nothing after it."""
    outcome, first = "", None
    async for line in response.aiter_lines():
        if not line:
            continue
        if outcome:
            tally.problems.append(f"http {path}: {line[:100]!r} after the stream's end ({outcome})")
            break
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            outcome = "done"
            continue
        event = json.loads(data)
        if "error" in event:
            outcome = event["error"]["code"]
            continue
        first = first or time.perf_counter()
        if hang_up:
            return "hung up", first
    return outcome or "stream cut without an end", first


# --- processes -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Footprint:
    """RSS (MiB) and open descriptors of the server's processes at one moment."""

    broker: tuple[float, int]
    gateway: tuple[float, int]
    workers: dict[int, tuple[float, int]]  # pid -> (RSS, descriptors)
    slots: list[str]  # the slot table's rows: worker.slot state served

    @classmethod
    def take(cls, server: MpserveServer, gateway: int) -> Footprint:
        rows = [r for r in _rows(server) if r.state is not SlotState.EMPTY]
        return cls(_usage(server.proc.pid), _usage(gateway), {pid: _usage(pid) for pid in _worker_pids(server)},
                   [f"w{r.worker}.{r.slot} {r.state.name.lower()} served {r.served}" for r in rows])


def _usage(pid: int) -> tuple[float, int]:
    rss = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
               if line.startswith("VmRSS:"))
    return rss / 1024, len(os.listdir(f"/proc/{pid}/fd"))


def _worker_pids(server: MpserveServer) -> list[int]:
    return sorted({pid for pid in server.worker_pids() if pid > 0})


def _rows(server: MpserveServer) -> list[Any]:
    info = ServerInfo.read(server.name)
    assert info is not None
    return SlotTable.read_rows(Path(info.slots))


def _gateway_pid(server: MpserveServer) -> int:
    for pid in children(server.proc.pid):
        if b"gateway" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise RuntimeError("no gateway process under the server")


async def _killer(server: MpserveServer, every_s: float, rng: random.Random, tally: Tally, until: float) -> None:
    while time.monotonic() + every_s < until:
        await asyncio.sleep(every_s)
        busy = sorted({r.pid for r in _rows(server) if r.state is SlotState.BUSY and r.pid > 0})
        if busy:
            os.kill(rng.choice(busy), signal.SIGKILL)
            tally.kills += 1


# --- the run ---------------------------------------------------------------------------------------

async def soak(server: MpserveServer, url: str, seconds: float, warmup_s: float, lanes: int, kill_every: float,
               seed: int) -> tuple[Tally, Footprint, Footprint, dict[str, int]]:
    rng = random.Random(seed)
    tally = Tally()
    ctx = zmq.asyncio.Context()
    zmq_front = ZmqFront(ctx, server.address, tally)
    gateway = _gateway_pid(server)
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_LIMIT_S) as http:
        async def lane(run: Callable[[str, random.Random], Awaitable[None]], kinds: dict[str, float],
                       until: float, lane_rng: random.Random) -> None:
            names, weights = list(kinds), list(kinds.values())
            while time.monotonic() < until:
                await run(lane_rng.choices(names, weights)[0], lane_rng)

        def zmq_run(kind: str, r: random.Random) -> Awaitable[None]:
            return zmq_front.run(kind, r)

        def http_run(kind: str, r: random.Random) -> Awaitable[None]:
            return http_request(http, kind, r, tally)

        async def phase(duration: float, kill: bool) -> None:
            until = time.monotonic() + duration
            work = [lane(zmq_run, ZMQ_KINDS, until, random.Random(rng.random())) for _ in range(lanes)]
            work += [lane(http_run, HTTP_KINDS, until, random.Random(rng.random())) for _ in range(lanes)]
            if kill and kill_every > 0:
                work.append(_killer(server, kill_every, rng, tally, until))
            await asyncio.gather(*work)

        await phase(warmup_s, kill=False)
        before = await _settled(server)
        start = Footprint.take(server, gateway)
        tally.outcomes.clear()  # what the warm-up's requests met is checked (problems), not counted
        tally.latency_s.clear()
        tally.ttft_s.clear()
        await phase(seconds, kill=True)
        after = await _settled(server)
        end = Footprint.take(server, gateway)
        tally.problems += zmq_front.not_ended_once()
    counters = {key: n - before.get(key, 0) for key, n in after.items() if n != before.get(key, 0)}
    ended = sum(counters.get(key, 0) for key in TERMINAL_COUNTERS)
    if ended != counters.get("accepted", 0):
        tally.problems.append(f"the broker accepted {counters.get('accepted', 0)} requests and ended {ended}")
    await zmq_front.close()
    ctx.term()
    return tally, start, end, counters


async def _settled(server: MpserveServer, timeout: float = 60.0) -> dict[str, int]:
    """Wait until the broker holds no request and every slot is idle (vanished clients' requests end once
    the broker stops hearing from them); the broker's counters then."""
    from mpserve import AsyncClient

    async with AsyncClient(server.address) as client:
        deadline = time.monotonic() + timeout
        while True:
            stats = await client.stats()
            idle = all(m.queued == m.running == 0 for m in stats.models.values())
            rows = [r for r in _rows(server) if r.state is not SlotState.EMPTY]
            if idle and all(r.state is SlotState.IDLE for r in rows):
                return stats.counters
            if time.monotonic() > deadline:
                raise RuntimeError(f"not settled after {timeout:g} s: {stats.models}, slots "
                                   f"{[r.state.name for r in rows]}")
            await asyncio.sleep(0.2)


def report(tally: Tally, start: Footprint, end: Footprint, counters: dict[str, int], seconds: float) -> list[str]:
    lines = ["| front | kind | outcome | requests |", "|---|---|---|---|"]
    lines += [f"| {f} | {k} | {o} | {n} |" for (f, k, o), n in sorted(tally.outcomes.items()) if n]
    total = sum(tally.outcomes.values())
    lines += ["", f"{total} requests in {seconds:.0f} s ({total / seconds:.1f}/s); {tally.kills} workers killed, "
              f"{tally.handovers} hand-overs seen by ZeroMQ requests (broker: resumed {counters.get('resumed', 0)}, "
              f"retried {counters.get('retried', 0)})", "",
              "| what succeeded | n | latency p50 / p90 / p99 ms | first token p50 / p99 ms |", "|---|---|---|---|"]
    for key, values in sorted(tally.latency_s.items()):
        ttft = tally.ttft_s.get(key, [])
        first = f"{percentile(ttft, 50) * 1e3:.0f} / {percentile(ttft, 99) * 1e3:.0f}" if ttft else "-"
        lines.append(f"| {key} | {len(values)} | " + " / ".join(f"{percentile(values, p) * 1e3:.0f}" for p in
                                                                (50, 90, 99)) + f" | {first} |")
    workers_start = sum(r for r, _ in start.workers.values())
    workers_end = sum(r for r, _ in end.workers.values())
    lines += ["", "| process | RSS MiB after warm-up → end | growth | descriptors |", "|---|---|---|---|"]
    for name, (a, fa), (b, fb) in (("broker", start.broker, end.broker), ("gateway", start.gateway, end.gateway)):
        lines.append(f"| {name} | {a:.1f} → {b:.1f} | {(b - a) / a:+.1%} | {fa} → {fb} |")
    same = set(start.workers) == set(end.workers)
    lines.append(f"| workers ({len(end.workers)}{'' if same else ', restarted'}) | {workers_start:.1f} → "
                 f"{workers_end:.1f} | {(workers_end - workers_start) / workers_start:+.1%} | "
                 f"{sum(f for _, f in start.workers.values())} → {sum(f for _, f in end.workers.values())} |")
    lines += ["", "slot table at the end: " + "; ".join(end.slots)]
    lines += ["", "broker counters over the run: " + ", ".join(f"{k} {v}" for k, v in sorted(counters.items()))]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="how long the load runs [default: 10]")
    parser.add_argument("--warmup", type=float, default=20.0, help="seconds of load before the first measurement "
                                                                   "of memory [default: 20]")
    parser.add_argument("--model", default="builtin:tiny", help="GGUF file or builtin:NAME [default: builtin:tiny]")
    parser.add_argument("--instances", type=int, default=2, help="instances of the model [default: 2]")
    parser.add_argument("--lanes", type=int, default=3, help="concurrent requests per front [default: 3]")
    parser.add_argument("--kill-every", type=float, default=20.0,
                        help="seconds between SIGKILLs of a busy worker; 0: none [default: 20]")
    parser.add_argument("--seed", type=int, default=1, help="for the traffic and the kills [default: 1]")
    args = parser.parse_args(argv)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    load = os.getloadavg()[0]
    with MpserveServer("--http", f"127.0.0.1:{port}", "--model", args.model, "--instances", str(args.instances),
                       "--threads", "1", "--n-ctx", "1024") as server:
        server.wait_ready()
        if not wait_http(url + "/health", 30.0):
            raise RuntimeError("the gateway did not become healthy")
        seconds = args.minutes * 60
        tally, start, end, counters = asyncio.run(soak(server, url, seconds, args.warmup, args.lanes,
                                                       args.kill_every, args.seed))
        tracebacks = [line for line in server.log if "Traceback" in line]
        alive = server.proc.poll() is None
    tally.problems += [f"{len(tracebacks)} traceback(s) in the server's log"] if tracebacks else []
    tally.problems += [] if alive else ["the server died"]
    print(f"# soak: {args.model}, {args.instances} instances, {args.lanes} lanes per front, {args.minutes:g} min "
          f"after {args.warmup:g} s of warm-up, a worker killed every {args.kill_every:g} s, seed {args.seed}; "
          f"load average (1 min) {load:.1f} before, {os.getloadavg()[0]:.1f} after\n")
    print("\n".join(report(tally, start, end, counters, seconds)))
    if tally.problems:
        print(f"\nFAILED: {len(tally.problems)} invariant(s) broken:\n" + "\n".join(tally.problems[:30]))
        return 1
    print("\nevery request ended exactly once, with an outcome its kind allows; nothing held at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
