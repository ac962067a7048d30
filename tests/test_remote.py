"""Remote worker pools over TCP on loopback: `mpserve worker --connect` processes registering with a broker
started with `--workers-bind`, heartbeats both ways, loss and re-registration, broker restarts, CURVE."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import zmq.auth
from conftest import ServerProcess, _die_with_parent
from engines import LONG_PROMPT as LONG
from engines import others
from helpers import dealer, free_port, mpserve, received, stopped, wait_for

from mpserve import AsyncClient, Client
from mpserve.engine.sequence import PROMPT_CHUNK
from mpserve.runtime import ServerInfo
from mpserve.wire import protocol as wire
from mpserve.wire import slots
from mpserve.wire.slots import SlotRow, SlotState, SlotTable

FAST = ["--heartbeat-interval", "0.25", "--heartbeat-liveness", "4"]  # lost after 1 s of silence



class Pool:
    """`python -m mpserve worker --connect …` in a subprocess."""

    def __init__(self, name: str, connect: str, *args: str) -> None:
        self.name = name
        self.log_path = Path(os.environ["MPSERVE_RUNTIME_DIR"]) / f"{name}.log"
        self.proc = subprocess.Popen([sys.executable, "-m", "mpserve", "worker", "--connect", connect,
                                      "--server-name", name, "--name", "tiny", *FAST, *args],
                                     stdout=self.log_path.open("w"), stderr=subprocess.STDOUT,
                                     preexec_fn=_die_with_parent)

    def pids(self) -> list[int]:
        """The pool process and its workers (workers run in sessions of their own)."""
        deadline = time.monotonic() + 30
        while (info := ServerInfo.read(self.name)) is None or info.pid != self.proc.pid:
            assert time.monotonic() < deadline, "pool never wrote its info file"
            time.sleep(0.05)
        return [self.proc.pid, *(r.pid for r in SlotTable.read_rows(Path(info.slots)) if r.pid)]

    def rows(self) -> list[SlotRow]:
        """The pool's slot table as it is now."""
        info = ServerInfo.read(self.name)
        assert info is not None
        return SlotTable.read_rows(Path(info.slots))

    def stop_busy_mid_update(self, pid: int) -> bool:
        """SIGSTOP worker ``pid`` as if in the middle of writing its slot rows: their sequences odd, as a stop can
        leave them on any token (each writes a row). False, and the worker let go on (SIGCONT), if it had no
        request running when it stopped (its row says idle before it answers one)."""
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: stopped(pid), 10, f"worker {pid} to stop")
        info = ServerInfo.read(self.name)
        assert info is not None
        table = SlotTable.attach(Path(info.slots))
        try:
            rows = [r for r in table.read_all() if r.pid == pid]
            if not any(r.state is SlotState.BUSY or r.stuck_s for r in rows):
                os.kill(pid, signal.SIGCONT)
                return False
            for row in rows:
                offset = slots._HEADER.size + row.index * slots.ROW_SIZE
                (seq,) = slots._SEQ.unpack_from(table._mm, offset)
                slots._SEQ.pack_into(table._mm, offset, seq | 1)
            return True
        finally:
            table.close()

    def stop(self) -> None:
        for pid in self.pids() if self.proc.poll() is None else []:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.proc.terminate()
        self.proc.wait(30)


@pytest.fixture
def pools():
    started: list[Pool] = []

    def start(*args: str) -> Pool:
        started.append(Pool(*args))
        return started[-1]

    yield start
    for pool in started:
        pool.stop()


def registered(address: str) -> Counter[str]:
    """Remote workers registered with the broker, by pool (host-pid)."""
    with Client(address) as client:
        return Counter(w.worker.rsplit("-w", 1)[0] for w in client.stats().workers if w.host)


def broker(start_server, port: int, *extra: str, name: str | None = None) -> ServerProcess:
    return start_server("--instances", "0", "--workers-bind", f"tcp://127.0.0.1:{port}", *FAST, *extra,
                        name=name).wait_ready()


@pytest.mark.timeout(120)
def test_two_pools_share_the_load_of_one_front_end(start_server, pools) -> None:
    port = free_port()
    server = broker(start_server, port)
    a, b = pools("pool-a", f"tcp://127.0.0.1:{port}", "--instances", "1"), pools(
        "pool-b", f"tcp://127.0.0.1:{port}", "--instances", "1")
    wait_for(lambda: len(registered(server.address)) == 2, 30, "both pools to register")

    async def run() -> list[object]:
        sem = asyncio.Semaphore(8)
        async with AsyncClient(server.address, timeout=60) as client:
            async def one(i: int) -> object:
                async with sem:
                    return await client.generate(f"r{i}", max_tokens=8, temperature=0)
            return await asyncio.gather(*(one(i) for i in range(200)), return_exceptions=True)

    results = asyncio.run(run())
    assert all(not isinstance(r, BaseException) for r in results), [r for r in results if isinstance(r, BaseException)]
    by_pool = Counter(r.worker.rsplit("-w", 1)[0] for r in results)  # type: ignore[union-attr]
    assert set(by_pool) == {f"{socket.gethostname()[:32]}-{a.proc.pid}", f"{socket.gethostname()[:32]}-{b.proc.pid}"}
    print(f"\n200 requests over two pools: {dict(by_pool)}")
    status = mpserve("status", "--server-name", server.name, timeout=30)
    assert status.stdout.count("remote ") == 2 and f"host {socket.gethostname()[:32]}" in status.stdout


@pytest.mark.timeout(120)
def test_a_silent_pool_is_declared_lost_and_comes_back(start_server, pools) -> None:
    port = free_port()
    server = broker(start_server, port)
    a = pools("pool-a", f"tcp://127.0.0.1:{port}", "--instances", "1")
    pools("pool-b", f"tcp://127.0.0.1:{port}", "--instances", "1")
    wait_for(lambda: len(registered(server.address)) == 2, 30, "both pools to register")
    pool_a = f"{socket.gethostname()[:32]}-{a.proc.pid}"

    stopped = a.pids()
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    t_stop = time.monotonic()
    wait_for(lambda: pool_a not in registered(server.address), 10, "the stopped pool to be declared lost")
    detect = time.monotonic() - t_stop
    with Client(server.address) as client:  # the other pool carries on alone
        served = {client.generate("x", max_tokens=4, timeout=20).worker.rsplit("-w", 1)[0] for _ in range(6)}
    assert pool_a not in served

    for pid in stopped:
        os.kill(pid, signal.SIGCONT)
    t_cont = time.monotonic()
    wait_for(lambda: pool_a in registered(server.address), 15, "the pool to register again")
    rejoin = time.monotonic() - t_cont
    with Client(server.address) as client:
        served = Counter(client.generate(f"y{i}", max_tokens=4).worker.rsplit("-w", 1)[0] for i in range(12))
    assert pool_a in served
    print(f"\nlost pool detected after {detect:.2f} s (expiry 1.0 s); re-registered {rejoin:.2f} s after SIGCONT")
    assert detect < 1.0 + 1.0 + 0.5  # expiry + 1 s, plus the broker's 0.5 s watchdog period


@pytest.mark.timeout(120)
def test_a_pool_replaces_a_worker_that_hangs_while_busy(start_server, pools) -> None:
    port = free_port()
    server = broker(start_server, port)
    pool = pools("pool-a", f"tcp://127.0.0.1:{port}", "--instances", "1", "--stall-timeout", "1", "--n-ctx", "8192")
    wait_for(lambda: sum(registered(server.address).values()) == 1, 30, "the pool to register")
    _, hung = pool.pids()
    with Client(server.address) as client:
        for _ in range(50):  # until the stop lands mid-stream: the tiny model may end its run before the signal
            stream = client.stream("hang here", max_tokens=300, temperature=0)
            chunks = iter(stream)
            texts = [next(chunks)]  # the worker is computing now
            # the hardest stop: its row says what the pool last read whole (idle, maybe)
            if pool.stop_busy_mid_update(hung):
                break
            list(chunks)
        else:
            pytest.fail("every run of the request ended before its worker stopped")
        try:
            texts += list(chunks)  # its heartbeats stopped too: the broker gave it up, the stream waits for a worker
        except Exception as exc:
            raise AssertionError("\n".join(["the broker's log:", *server.log, "the pool's log:",
                                             *pool.log_path.read_text().splitlines()])) from exc
        assert stream.result is not None and stream.result.timings.attempts == 2  # resumed on the new worker
        assert "".join(texts) == stream.result.text and stream.result.usage.completion_tokens == 300
        wait_for(lambda: len(pids := pool.pids()) == 2 and pids[1] != hung, 30, "the pool to start a new worker")
        assert pool.proc.poll() is None
        with pytest.raises(ProcessLookupError):
            os.kill(hung, 0)  # the hung worker was killed, not left behind
        wait_for(lambda: sum(registered(server.address).values()) == 1, 30, "the new worker to register")
        assert client.generate("after", max_tokens=4, timeout=20).usage.completion_tokens == 4
    assert any("made no progress" in line for line in pool.log_path.read_text().splitlines())


@pytest.mark.timeout(120)
def test_pools_reconnect_to_a_restarted_broker(start_server, pools) -> None:
    port = free_port()
    server = broker(start_server, port, name="restarted")
    pool = pools("pool-a", f"tcp://127.0.0.1:{port}", "--instances", "2")
    wait_for(lambda: sum(registered(server.address).values()) == 2, 30, "the pool to register")
    server.stop()
    server = broker(start_server, port, name="restarted")
    restarted = time.monotonic()
    wait_for(lambda: sum(registered(server.address).values()) == 2, 10, "the pool to come back")
    with Client(server.address) as client:
        try:
            assert client.generate("back", max_tokens=4, timeout=10).usage.completion_tokens == 4
        except Exception as exc:
            raise AssertionError("\n".join(["the broker's log:", *server.log, "the pool's log:",
                                             *pool.log_path.read_text().splitlines()])) from exc
    print(f"\npool served again {time.monotonic() - restarted:.2f} s after the broker restarted")


@pytest.mark.timeout(120)
def test_a_restarted_broker_learns_what_the_pools_host_store_holds_when_its_workers_register_again(start_server,
                                                                                                   pools) -> None:
    port = free_port()
    server = broker(start_server, port, name="cache-view")
    pools("pool-c", f"tcp://127.0.0.1:{port}", "--instances", "2", "--parallel", "1", "--n-ctx", "1024",
          "--cache-ram", "64MiB", "--reuse", "exact")
    wait_for(lambda: sum(registered(server.address).values()) == 2, 30, "the pool to register")
    with Client(server.address, timeout=60) as client:
        holder = client.generate(LONG, max_tokens=8, temperature=0).worker
        served = [client.generate(prompt, max_tokens=8, temperature=0).worker for prompt in others(8)]
        assert served.count(holder) == 4  # LONG left its slot; the pool's host store holds it
    server.proc.kill()  # a crash: a broker that stops tells the workers to stop
    server.proc.wait(10)
    server = broker(start_server, port, name="cache-view")  # knows nothing of either instance
    wait_for(lambda: sum(registered(server.address).values()) == 2, 10, "the pool to come back")
    with Client(server.address, timeout=60) as client:
        again = client.generate(LONG + " and then the cat sat", max_tokens=8, temperature=0)
        counters = client.stats().counters
    assert again.timings.cached_tokens == PROMPT_CHUNK  # routed by its READY's view of the host store, restored
    assert counters["routed_ram_prefix"] == 1 and again.worker.startswith(holder.rsplit("-", 1)[0])  # by the pool


@pytest.mark.timeout(120)
def test_a_pool_without_an_allowed_key_never_gets_a_request(start_server, pools, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    for folder, name in ((keys, "server"), (keys / "clients", "client"), (keys / "workers", "good"),
                         (keys / "others", "bad")):
        assert mpserve("keygen", str(folder), name, timeout=30).returncode == 0
    port = free_port()
    server = broker(start_server, port, "--curve-secret", str(keys / "server.key_secret"),
                    "--curve-clients", str(keys / "clients"), "--curve-workers", str(keys / "workers"))
    curve = ["--curve-server-key", str(keys / "server.key")]
    bad = pools("pool-bad", f"tcp://127.0.0.1:{port}", *curve, "--curve-secret", str(keys / "others/bad.key_secret"))
    wait_for(lambda: any("refused a connection" in line for line in server.log), 30, "the broker to log a refusal")
    client_keys = {"curve_server_key": str(keys / "server.key"),
                   "curve_secret": str(keys / "clients/client.key_secret")}
    with Client(server.address, **client_keys) as client:
        assert not [w for w in client.stats().workers if w.host]
        pools("pool-good", f"tcp://127.0.0.1:{port}", *curve, "--curve-secret", str(keys / "workers/good.key_secret"))
        wait_for(lambda: [w for w in client.stats().workers if w.host], 30, "the allowed pool to register")
        assert client.generate("hi", max_tokens=4, timeout=20).worker.startswith(socket.gethostname()[:32])
    bad_key = zmq.auth.load_certificate(str(keys / "others" / "bad.key"))[0].decode()
    refusal = next(line for line in server.log if "refused a connection" in line)
    assert f"client_key={bad_key}" in refusal and "b'" not in refusal  # the key as its file writes it
    unkeyed = mpserve("status", "--server-name", server.name, timeout=30)
    assert unkeyed.returncode == 0 and "remote " not in unkeyed.stdout
    assert "--curve-server-key (MPSERVE_CURVE_SERVER_KEY)" in unkeyed.stderr, unkeyed.stderr
    assert "--curve-secret (MPSERVE_CURVE_CLIENT_SECRET)" in unkeyed.stderr
    keyed = mpserve("status", "--server-name", server.name, "--curve-server-key", client_keys["curve_server_key"],
                    "--curve-secret", client_keys["curve_secret"], timeout=30)
    assert keyed.returncode == 0 and "remote " in keyed.stdout and not keyed.stderr, keyed.stderr
    elsewhere = mpserve("models", "--server-name", f"{server.name}-not", timeout=30)
    assert elsewhere.returncode == 1 and "running here: " in elsewhere.stderr and server.name in elsewhere.stderr
    shutil.copy(keys / "others" / "bad.key", keys / "workers" / "bad.key")  # allowed from the broker's next start
    server.stop()
    server = broker(start_server, port, "--curve-secret", str(keys / "server.key_secret"),
                    "--curve-clients", str(keys / "clients"), "--curve-workers", str(keys / "workers"))
    with Client(server.address, **client_keys) as client:  # the refused pool's worker kept connecting afresh
        wait_for(lambda: len({w.worker for w in client.stats().workers if w.host}) == 2, 30, "both pools to register")
    bad.stop()  # its workers, refused, leave when told (they once hung sending to a link with no room, until killed)
    assert bad.proc.returncode == 0 and "killing it" not in bad.log_path.read_text(), bad.log_path.read_text()


@pytest.mark.timeout(60)
def test_a_worker_speaking_another_protocol_version_is_refused_with_both_versions(start_server) -> None:
    port = free_port()
    server = broker(start_server, port)
    with dealer(f"tcp://127.0.0.1:{port}", identity=b"old-worker") as sock:
        ready = wire.Ready("old-worker", "tiny", -1, 1, 1, host="elsewhere")
        sock.send_multipart([b"MPS0", bytes([wire.MsgType.READY]), b"", wire.pack(ready)])
        refusal = received(sock)
    assert isinstance(refusal, wire.Error) and refusal.code == "protocol"
    assert re.search(r"MPS0.*MPS1|MPS1.*MPS0", refusal.message), refusal.message
    with Client(server.address) as client:
        assert not client.stats().workers
    assert any("refused a message from worker" in line for line in server.log)


def _stream_through_a_pools_end(server: ServerProcess, pools: dict[int, Pool], end: signal.Signals
                                ) -> tuple[Pool, str]:
    """A greedy stream while ``end`` hits the pool process (not its workers) running it: the stream goes on
    elsewhere with the text of the same request run without a break, and its timings are the whole request's.
    The pool ended, and the worker that ran the request."""
    prompt, max_tokens = "Once upon a time", 400
    with Client(server.address, timeout=120) as client:
        whole = client.generate(prompt, max_tokens=max_tokens, temperature=0)
        for _ in range(50):  # until the stop lands mid-stream: the tiny model may end its run before the signal
            t_sent = time.monotonic()
            stream = client.stream(prompt, max_tokens=max_tokens, temperature=0)
            chunks = iter(stream)
            texts = [next(chunks)]
            t_first = time.monotonic()
            # stopped so that the pool ends mid-stream, and before the pool's SIGTERM comes: one that reached it
            # first, both pending, would be handled first (the lower number) and the worker would stop with nothing
            # left to wake it to leave
            if (running := _stop_the_running_worker(pools)) is not None:
                break
            list(chunks)
        else:
            pytest.fail("every run of the request ended before its worker stopped")
        pool, worker_pid, ran = running
        os.kill(pool.proc.pid, end)
        if end == signal.SIGKILL:
            pool.proc.wait(10)
        else:  # the pool passed it on to its workers (and kills them 2 s later: a slow poll may find it gone)
            wait_for(lambda: _pending(worker_pid, signal.SIGTERM), 10, "the pool to terminate its workers")
        # the pool's other worker gone first, so that the request goes on in the other pool, not there
        wait_for(lambda: registered(server.address)[ran.rsplit("-w", 1)[0]] == 1, 10, "the pool's idle worker to go")
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker_pid, signal.SIGCONT)
        texts += list(chunks)
        took = time.monotonic() - t_sent
    result = stream.result
    assert result is not None and result.worker != ran and result.timings.attempts == 2
    assert "".join(texts) == result.text == whole.text and result.usage == whole.usage
    t = result.timings  # the whole request's: not the first instance's run counted as queueing
    assert t.queue_ms + t.prompt_ms <= (t_first - t_sent) * 1000
    assert t.queue_ms + t.prompt_ms + t.generate_ms <= took * 1000
    return pool, ran


def _stop_the_running_worker(pools: dict[int, Pool]) -> tuple[Pool, int, str] | None:
    """Every worker of ``pools`` stopped (SIGSTOP), the one whose slot row says busy (a worker says idle before it
    answers) is left so, the others go on: its pool, pid and name; None, all going on, if none was busy."""
    workers = {pid for pool in pools.values() for pid in pool.pids()[1:]}
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    for pid in workers:
        wait_for(lambda pid=pid: stopped(pid), 10, "the worker to stop")
    found = None
    for pool in pools.values():
        if busy := [r for r in pool.rows() if r.pid in workers and r.state is SlotState.BUSY]:
            found = (pool, busy[0].pid, f"{socket.gethostname()[:32]}-{pool.proc.pid}-w{busy[0].worker}")
    for pid in workers:
        if found is None or pid != found[1]:
            os.kill(pid, signal.SIGCONT)
    return found


def _pending(pid: int, sig: signal.Signals) -> bool:
    """Whether ``sig`` waits to be delivered to the (stopped) process ``pid``, or the process is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
    except FileNotFoundError:
        return True
    masks = [int(line.split()[1], 16) for line in status if line.startswith(("SigPnd:", "ShdPnd:"))]
    return any(mask >> (sig - 1) & 1 for mask in masks)


def _two_pools(start_server, pools) -> tuple[ServerProcess, dict[int, Pool]]:
    """A broker that declares a silent worker lost only after 30 s, and two pools of 2 instances, by pid. The
    pools' workers keep the broker's heartbeats: with FAST's (silent for 1 s: lost), a worker would take a broker
    that beats once a second for gone whenever a beat came late on a busy host, and connect again under its name
    while the broker still held the old link, which refuses the new one (and its LEAVING) until that link's 30 s
    of silence are over."""
    port = free_port()
    beats = ("--heartbeat-interval", "1", "--heartbeat-liveness", "30")
    server = broker(start_server, port, *beats)
    started = {}
    for name in ("pool-a", "pool-b"):
        pool = pools(name, f"tcp://127.0.0.1:{port}", "--instances", "2", "--n-ctx", "1024", *beats,
                     "--reuse", "exact")  # a stream handed over keeps the uninterrupted text
        started[pool.proc.pid] = pool
    wait_for(lambda: sum(registered(server.address).values()) == 4, 60, "both pools to register")
    return server, started


def _left(server: ServerProcess, pool: Pool, within: float) -> Counter[str]:
    """Wait until ``pool``'s workers are gone from the broker, long before their silence would count (30 s):
    they left. The broker's counters then."""
    wait_for(lambda: f"{socket.gethostname()[:32]}-{pool.proc.pid}" not in registered(server.address), within,
             "the pool's workers to leave")
    with Client(server.address) as client:
        counters = Counter(client.stats().counters)
    assert counters["worker_left"] == 2 and not counters["worker_expired"], counters
    assert not counters["cancelled"] and not counters["worker_lost"], counters
    return counters


@pytest.mark.timeout(180)
def test_a_pool_killed_mid_stream_hands_its_requests_over_not_cancelled(start_server, pools) -> None:
    server, started = _two_pools(start_server, pools)
    killed, ran = _stream_through_a_pools_end(server, started, signal.SIGKILL)
    _left(server, killed, 10)  # its workers noticed the pool gone
    assert any(f"worker {ran} on " in line and "is gone" in line for line in server.log), "\n".join(server.log)
    assert not [line for line in server.log if "supervisor" in line], "\n".join(server.log)


@pytest.mark.timeout(180)
def test_a_pool_stopped_with_sigterm_deregisters_at_once_and_its_requests_go_on_elsewhere(start_server, pools
                                                                                        ) -> None:
    server, started = _two_pools(start_server, pools)
    stopped, _ = _stream_through_a_pools_end(server, started, signal.SIGTERM)
    assert stopped.proc.wait(10) == 0
    _left(server, stopped, 3)
    assert any("got SIGTERM" in line for line in server.log), "\n".join(server.log)
