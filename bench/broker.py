"""The broker at scale: how many streamed chunks per second it forwards, and the latency it adds.

A pool of fast instances is simulated by the echo backend with ``echo_tick_ms``: every running sequence of
every worker makes one piece per tick, stamped with the host's monotonic clock, and the server sends every
piece as its own CHUNK (``stream_interval: 0``, the heaviest case). Client processes keep streams open on
raw DEALER sockets and take each chunk's arrival time minus its stamp: the latency that the worker loop,
the broker and the client's own decoding added to a token.

    client processes (DEALER, streams)  <->  broker (ROUTER)  <->  workers: echo, K slots, a piece per tick

Steps raise the number of open streams, so the offered rate (streams ÷ tick) rises to the pool's full
size. Each step reports the chunks/s forwarded (baseline: the rate offered), the added latency p50 and p99
(baseline: the 5 ms budget), and the broker process's CPU per forwarded chunk (baseline: the CPU of every
process of the run per chunk, so the ratio is the broker's share). The knee is the highest forwarded rate
whose p99 stays within the budget. With py-spy on PATH the broker is profiled during the last step and its
functions with the most own time are listed in the notes.
"""

from __future__ import annotations

import multiprocessing
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import msgpack
import yaml
import zmq

from mpserve.wire import protocol as wire

from .figures import Case, Figure, Section, Target, percentile
from .procs import MpserveServer, cpu_seconds, py_spy
from .settings import Settings

BUDGET_MS = 5.0  # the added p99 latency the issue allows
RATE_TARGET = 50_000.0
CLIENTS = 2  # client processes; each keeps half the streams
LATENCY_SAMPLES = 20_000  # per client and step: every chunk counts toward the rate, the first ones toward latency
PROFILE_TOP = 12


@dataclass(frozen=True)
class Pool:
    instances: int
    parallel: int
    tick_ms: float
    max_tokens: int  # pieces per request: streams end and new ones start all through a step

    @property
    def slots(self) -> int:
        return self.instances * self.parallel


@dataclass(frozen=True)
class Step:
    streams: int
    offered: float  # chunks/s
    forwarded: float  # chunks/s
    p50_ms: float
    p99_ms: float
    broker_cpu_us: float  # per chunk
    total_cpu_us: float  # per chunk: broker, workers and clients
    ended: Counter[str]


def run(settings: Settings) -> Section:
    pool = Pool(2, 8, 10.0, 50) if settings.quick else Pool(8, 32, 5.0, 200)
    window_s = 1.0 if settings.quick else 5.0
    steps = [pool.slots // 8, pool.slots // 2, pool.slots] if settings.quick else \
        [8, 32, pool.slots // 4, pool.slots // 2, 3 * pool.slots // 4, pool.slots]
    section = Section("broker", "The broker at scale (simulated workers: echo, a stamped piece per tick)",
                      "rate offered; latency budget; CPU of the whole run")
    cases = {n: Case({"streams": str(n), "offered": f"{n * 1000 / pool.tick_ms:,.0f} chunks/s"},
                     [Figure("chunks/s", "chunks/s"), Figure("added p50", "ms"), Figure("added p99", "ms"),
                      Figure("broker CPU/chunk", "µs")]) for n in steps}
    sleeping = Case({"streams": f"{pool.slots}, --busy-poll-us 0", "offered": cases[steps[-1]].labels["offered"]},
                    [Figure(f.metric, f.unit) for f in cases[steps[-1]].figures])
    profile: list[str] = []
    with tempfile.TemporaryDirectory() as tmp, _server(pool, Path(tmp), "default") as server, \
            _server(pool, Path(tmp), "sleeping", busy_poll_us=0) as asleep:
        for repeat in range(settings.repeat):
            for n, case, on in [*((n, cases[n], server) for n in steps), (steps[-1], sleeping, asleep)]:
                last = repeat == settings.repeat - 1 and case is cases[steps[-1]]
                broker_pid = on.proc.pid
                step = _step(on.address, pool, n, window_s, [broker_pid, *on.worker_pids()], broker_pid,
                             profile if last and shutil.which("py-spy") else None, Path(tmp))
                case.figure("chunks/s").add(step.forwarded, step.offered)
                case.figure("added p50").add(step.p50_ms, BUDGET_MS)
                case.figure("added p99").add(step.p99_ms, BUDGET_MS)
                case.figure("broker CPU/chunk").add(step.broker_cpu_us, step.total_cpu_us)
                if set(step.ended) - {"done"}:
                    section.notes.append(f"{case.labels['streams']} streams: requests ended {dict(step.ended)}")
    section.cases = [*cases.values(), sleeping]
    within = [c.figure("chunks/s").value for c in cases.values() if c.figure("added p99").value <= BUDGET_MS]
    knee = max(within, default=0.0)
    section.targets.append(Target(f"chunks/s forwarded with added p99 ≤ {BUDGET_MS:g} ms: ≥ {RATE_TARGET:,.0f}",
                                  knee, ">=", RATE_TARGET, "chunks/s"))
    section.notes.append(
        f"{pool.instances} echo instances × {pool.parallel} slots, a piece every {pool.tick_ms:g} ms per sequence, "
        f"{pool.max_tokens} pieces per request, every piece its own CHUNK (those of one worker step for one client "
        f"travel as one CHUNKS message); {CLIENTS} client processes on raw "
        f"DEALER sockets (msgpack bodies, no validation); {window_s:g} s measured per step after the streams "
        "are open. Latency: a chunk's arrival minus the time the worker made its piece (same host clock). "
        "CPU: the broker process (every thread); its baseline is every process of the run, clients included. "
        "The broker busy-polls for a moment after each message while it has CPU to spare "
        "(mpserve.server.waiting), so at low rates its CPU per chunk is mostly polling; the last row is the full "
        "rate on a second server with polling off, the cost of forwarding alone. Both servers stay up, the "
        "idle one's workers asleep.")
    if profile:
        section.notes.append("py-spy, broker, own time at the last step: " + "; ".join(profile))
    elif not shutil.which("py-spy"):
        section.notes.append("no py-spy on PATH: the broker was not profiled (pip install py-spy)")
    return section


def _server(pool: Pool, tmp: Path, name: str, **settings: float) -> MpserveServer:
    config = {"stream_interval": 0, "max_pending_per_client": 4 * pool.slots, "max_queue": 4 * pool.slots,
              **settings,
              "models": [{"name": "sim", "path": "echo", "instances": pool.instances, "parallel": pool.parallel,
                          "echo_tick_ms": pool.tick_ms}]}
    path = tmp / f"broker-bench-{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    server = MpserveServer("--config", str(path))
    server.wait_ready()
    return server


def _step(address: str, pool: Pool, streams: int, window_s: float, pids: list[int], broker_pid: int,
          profile: list[str] | None, tmp: Path) -> Step:
    """Open ``streams`` streams over the client processes, then measure for ``window_s``."""
    context = multiprocessing.get_context("spawn")
    pipes, procs = [], []
    for i in range(CLIENTS):
        share = streams // CLIENTS + (1 if i < streams % CLIENTS else 0)
        mine, theirs = context.Pipe()
        proc = context.Process(target=_client, args=(address, pool.max_tokens, share, window_s, theirs, i),
                               daemon=True)
        proc.start()
        pipes.append(mine)
        procs.append(proc)
    try:
        for pipe in pipes:  # each has its streams open and its first chunks in
            if not pipe.poll(60):
                raise RuntimeError("a bench client did not open its streams within 60 s")
            pipe.recv()
        client_pids = [p.pid for p in procs if p.pid is not None]
        before = {pid: cpu_seconds(pid) for pid in [*pids, *client_pids]}
        for pipe in pipes:
            pipe.send("go")
        spy = _profile(broker_pid, window_s, tmp) if profile is not None else None
        results = []
        for pipe in pipes:
            if not pipe.poll(window_s + 60):
                raise RuntimeError("a bench client did not report")
            results.append(pipe.recv())
        cpu = {pid: cpu_seconds(pid) - before[pid] for pid in before}
        if spy is not None and profile is not None:
            profile.extend(_top_functions(spy))
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    chunks = sum(r[0] for r in results)
    latencies = [x for r in results for x in r[1]]
    ended: Counter[str] = Counter()
    for r in results:
        ended.update(r[2])
    return Step(streams, streams * 1000 / pool.tick_ms, chunks / window_s, percentile(latencies, 50),
                percentile(latencies, 99), cpu[broker_pid] / max(chunks, 1) * 1e6,
                sum(cpu.values()) / max(chunks, 1) * 1e6, ended)


def _client(address: str, max_tokens: int, streams: int, window_s: float, pipe: Connection, which: int) -> None:
    """Keep ``streams`` streams open (a new request as each ends) until told to go, count for ``window_s``,
    then cancel what is open and wait for it to end, so the next step starts on an idle pool."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(address)
    params = wire.GenerateParams(max_tokens=max_tokens, temperature=0.0)
    serial = iter(range(1 << 62))
    open_ids: set[str] = set()

    def submit() -> None:
        rid = f"c{which}-{next(serial)}"
        open_ids.add(rid)
        sock.send_multipart(wire.encode(wire.Request(rid, "x", "sim", params, stream=True)))

    for _ in range(streams):
        submit()
    chunk_type, chunks_type = wire.TYPE_FRAMES[wire.MsgType.CHUNK], wire.TYPE_FRAMES[wire.MsgType.CHUNKS]
    done_type = wire.TYPE_FRAMES[wire.MsgType.DONE]
    phase = "opening"  # → "waiting" (told the parent) → "counting" → "draining" (cancelled what is open)
    counting_until = 0.0
    chunks = 0
    latencies: list[float] = []
    ended: Counter[str] = Counter()
    try:
        while phase != "draining" or open_ids:
            if not sock.poll(10_000):
                raise RuntimeError(f"no message for 10 s ({phase}, {len(open_ids)} open)")
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                now = time.monotonic_ns()
                body = msgpack.unpackb(frames[2])
                if frames[1] in (chunk_type, chunks_type):
                    got = body if frames[1] == chunks_type else [body]
                    if phase == "counting":
                        chunks += len(got)
                        for chunk in got[:LATENCY_SAMPLES - len(latencies)]:
                            latencies.append((now - int(chunk["text"].split(" ", 1)[0])) / 1e6)
                    elif phase == "opening":
                        phase = "waiting"
                        pipe.send("open")
                    continue
                open_ids.discard(body.get("id"))
                if phase != "draining":
                    ended["done" if frames[1] == done_type else str(body.get("code"))] += 1
                    submit()
            if phase == "waiting" and pipe.poll():
                pipe.recv()
                phase, counting_until = "counting", time.monotonic() + window_s
            elif phase == "counting" and time.monotonic() >= counting_until:
                phase = "draining"
                for rid in open_ids:
                    sock.send_multipart(wire.encode(wire.Cancel(rid)))
        pipe.send((chunks, latencies, ended))
    finally:
        sock.close()
        ctx.term()


@dataclass
class _Profile:
    """py-spy sampling a process, its collapsed stacks going to ``output``."""

    process: subprocess.Popen[bytes]
    output: Path


def _profile(pid: int, seconds: float, tmp: Path) -> _Profile:
    output = tmp / f"py-spy-{pid}.txt"
    return _Profile(py_spy(pid, seconds, output), output)


def _top_functions(spy: _Profile) -> list[str]:
    """The functions with the most own samples, as 'function (file:line) N%'."""
    spy.process.wait(60)
    path = spy.output
    if not path.exists():
        return ["py-spy wrote no profile (it needs ptrace rights over the broker)"]
    own: Counter[str] = Counter()
    try:
        for line in path.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if stack:
                own[stack.split(";")[-1]] += int(count)
    finally:
        path.unlink(missing_ok=True)
    total = sum(own.values()) or 1
    return [f"{frame.strip()} {n / total:.0%}" for frame, n in own.most_common(PROFILE_TOP)]
