"""Dispatch overhead: the broker path alone, against a raw pyzmq echo between two processes.

mpserve runs the built-in ``echo`` backend (no model): each request goes client -> broker -> worker ->
broker -> client and is answered at once. The floor is a DEALER client and a ROUTER in another process
that sends every message straight back: two processes, one ipc round trip, no decoding on the server.

The server runs two ways: one instance with one slot (each request waits for the one before it to be
answered: at 64 in flight this is the broker <-> worker round trip, not the broker's capacity) and one
instance with 64 slots (``--parallel 64``: the 64 in flight run at once, so the rate is what broker and
worker can process, the figure that matters for a pool of many slots). A third server, one slot with
``--busy-poll-us 0``, shows at 1 in flight what the broker's busy polling (``mpserve.server.waiting``) buys
and what CPU it spends.

Two clients drive mpserve:

- raw DEALER: a plain DEALER socket speaking mpserve.wire.protocol, with requests encoded before the clock
  starts and each reply decoded (``protocol.decode``, as any client must). The same loop drives the
  floor, so the ratio is the cost of the broker and worker alone. This is the lowest-overhead path.
- AsyncClient: mpserve's own asyncio client, one ``generate`` per request. It adds an asyncio task,
  a queue and a result object per request; its ratio to the floor includes that client cost.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import time
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event

import zmq

from mpserve import AsyncClient
from mpserve.runtime import runtime_dir
from mpserve.wire import protocol as wire

from .figures import Case, Figure, Section, Target, percentile
from .procs import CpuMeter, MpserveServer
from .settings import Settings

IN_FLIGHT = (1, 64)
WIDE = 64  # slots of the second server: as many as requests in flight
NARROW = "1"
SLEEPING = "1, --busy-poll-us 0"
P50_TARGET = 2.5
RATE_TARGET = 10_000.0
_names = itertools.count(1)


@dataclass(frozen=True)
class RoundTrips:
    latencies_s: list[float]
    wall_s: float
    server_cpu_us: float  # per request: every thread of the server's processes
    client_cpu_us: float  # per request: every thread of this process

    @property
    def rate(self) -> float:
        return len(self.latencies_s) / self.wall_s

    def micros(self, percent: float) -> float:
        return percentile(self.latencies_s, percent) * 1e6


def run(settings: Settings) -> Section:
    section = Section("dispatch", "Dispatch overhead (echo backend, no model)",
                      "raw pyzmq DEALER→ROUTER echo between two processes, same client loop")
    counts = {1: settings.pick(100, 3000), 64: settings.pick(1000, 30000)}
    clients = {"raw DEALER": _dealer_round_trips, "AsyncClient": _async_round_trips}
    runs = [(NARROW, k) for k in IN_FLIGHT] + [(str(WIDE), IN_FLIGHT[-1]), (SLEEPING, 1)]  # (server, in flight)
    cases = {(client, server, k): Case({"client": client, "slots": server, "in flight": str(k)},
                                       [Figure("p50", "µs"), Figure("p99", "µs"), Figure("req/s", "req/s"),
                                        Figure("server CPU/req", "µs"), Figure("client CPU/req", "µs")])
             for client in clients for server, k in runs}
    floor_address = f"ipc://{runtime_dir()}/floor{next(_names)}.sock"
    floor = _start_floor(floor_address)
    try:
        with MpserveServer("--model", "echo", "--instances", "1") as narrow, \
                MpserveServer("--model", "echo", "--instances", "1", "--parallel", str(WIDE)) as wide, \
                MpserveServer("--model", "echo", "--instances", "1", "--busy-poll-us", "0") as sleeping:
            servers = {NARROW: narrow, str(WIDE): wide, SLEEPING: sleeping}
            for server in servers.values():
                server.wait_ready()
            pids = {label: [server.proc.pid, *server.worker_pids()] for label, server in servers.items()}
            for _ in range(settings.repeat):
                for label, k in runs:
                    base = _dealer_round_trips(floor_address, counts[k], k, [floor.pid])
                    for client, measure in clients.items():
                        got = measure(servers[label].address, counts[k], k, pids[label])
                        for figure, value, baseline in zip(cases[client, label, k].figures, _figures(got),
                                                           _figures(base), strict=True):
                            figure.add(value, baseline)
    finally:
        floor.terminate()
        floor.join()
    section.cases = list(cases.values())
    for client in clients:
        p50 = cases[client, NARROW, 1].figure("p50")
        section.targets.append(
            Target(f"dispatch p50, 1 in flight, {client}: ≤ {P50_TARGET}× raw", p50.ratio, "<=", P50_TARGET))
        for label in (NARROW, str(WIDE)):
            rate = cases[client, label, IN_FLIGHT[-1]].figure("req/s")
            section.targets.append(
                Target(f"dispatch rate, 64 in flight, {label} slot{'s' if label != NARROW else ''}, {client}: "
                       f"≥ {RATE_TARGET:,.0f} req/s", rate.value, ">=", RATE_TARGET, "req/s"))
    section.notes.append(f"mpserve runs 1 echo instance, with 1 slot or with {WIDE}; \"{SLEEPING}\" is one slot "
                         "with the broker's busy polling off (it blocks in poll at once after each message). "
                         "Requests per measurement: "
                         f"{counts[1]} at 1 in flight, "
                         f"{counts[64]} at 64. raw DEALER encodes requests before timing and decodes every reply; "
                         "it measures the broker path alone. AsyncClient adds mpserve's client cost. CPU per request "
                         "counts every thread (ZeroMQ's I/O threads too): server = broker + worker (the floor: its "
                         "echo process), client = the bench process.")
    return section


def _figures(got: RoundTrips) -> tuple[float, ...]:
    return got.micros(50), got.micros(99), got.rate, got.server_cpu_us, got.client_cpu_us


# --- the floor: a ROUTER that sends every message back -------------------------------------------------

def _start_floor(address: str) -> BaseProcess:
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    process = context.Process(target=_echo_forever, args=(address, ready), daemon=True)
    process.start()
    if not ready.wait(30):
        process.terminate()
        raise RuntimeError("the raw echo process did not start")
    return process


def _echo_forever(address: str, ready: Event) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 10000)
    sock.setsockopt(zmq.RCVHWM, 10000)
    sock.bind(address)
    ready.set()
    while True:
        sock.send_multipart(sock.recv_multipart(copy=False), copy=False)


# --- the clients ----------------------------------------------------------------------------------------

def _dealer_round_trips(address: str, n: int, in_flight: int, server_pids: list[int]) -> RoundTrips:
    """Keep ``in_flight`` requests outstanding on one DEALER until ``n`` have come back."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        _dealer_pass(sock, _encoded(min(n, 200), "w"), in_flight)  # connect and warm up, untimed
        requests = _encoded(n, "r")
        with CpuMeter(server_pids) as cpu:
            latencies, wall = _dealer_pass(sock, requests, in_flight)
        return RoundTrips(latencies, wall, cpu.others_s / n * 1e6, cpu.own_s / n * 1e6)
    finally:
        sock.close()
        ctx.term()


def _encoded(n: int, prefix: str) -> list[list[bytes]]:
    params = wire.GenerateParams(max_tokens=1, temperature=0.0)
    return [wire.encode(wire.Request(f"{prefix}{i:x}", "ping", None, params)) for i in range(n)]


def _dealer_pass(sock: zmq.Socket, requests: list[list[bytes]], in_flight: int) -> tuple[list[float], float]:
    n = len(requests)
    sent_at = [0.0] * n
    latencies = []
    started = time.perf_counter()
    sent = 0
    while sent < min(in_flight, n):
        sent_at[sent] = time.perf_counter()
        sock.send_multipart(requests[sent])
        sent += 1
    while len(latencies) < n:
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:  # poll only when nothing is waiting: one system call less per reply under load
            if not sock.poll(10_000):
                raise RuntimeError(f"no reply for 10 s ({len(latencies)} of {n} back)") from None
            continue
        arrived = time.perf_counter()
        reply = wire.decode(frames)
        if not isinstance(reply, (wire.Done, wire.Request)):
            raise RuntimeError(f"unexpected reply {reply}")
        latencies.append(arrived - sent_at[int(reply.id[1:], 16)])
        if sent < n:
            sent_at[sent] = time.perf_counter()
            sock.send_multipart(requests[sent])
            sent += 1
    return latencies, time.perf_counter() - started


def _async_round_trips(address: str, n: int, in_flight: int, server_pids: list[int]) -> RoundTrips:
    async def main() -> RoundTrips:
        async with AsyncClient(address) as client:
            await _async_pass(client, min(n, 200), in_flight)
            with CpuMeter(server_pids) as cpu:
                latencies, wall = await _async_pass(client, n, in_flight)
            return RoundTrips(latencies, wall, cpu.others_s / n * 1e6, cpu.own_s / n * 1e6)

    return asyncio.run(main())


async def _async_pass(client: AsyncClient, n: int, in_flight: int) -> tuple[list[float], float]:
    counter = itertools.count()
    latencies: list[float] = []

    async def lane() -> None:
        while next(counter) < n:
            sent = time.perf_counter()
            await client.generate("ping", max_tokens=1, temperature=0.0)
            latencies.append(time.perf_counter() - sent)

    started = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(in_flight)))
    return latencies, time.perf_counter() - started
