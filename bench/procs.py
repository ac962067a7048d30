"""Processes a benchmark starts: mpserve servers, HTTP peer servers, and what they cost in memory.

Every server runs as its own subprocess, started the way a user would start it, and is stopped by the
``with`` block that started it, or by the kernel when the bench dies (killed, or timed out by a test's harness):
no server outlives its bench to weigh on the next measurement.
"""

from __future__ import annotations

import ctypes
import glob
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from mpserve.runtime import ServerInfo
from mpserve.wire.slots import SlotTable

READY_TIMEOUT_S = 120.0
LLAMA_SERVER_PLACES = ("/opt/llama-server*/llama-server", "/opt/llama-server*/bin/llama-server",
                       "/tmp/lcp*/build/bin/llama-server")
"""Where a llama-server built by hand (see bench/README.md) usually lands, when it is not on PATH."""
_names = itertools.count(1)


PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before it runs: SIGTERM when the bench process is gone."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class ServerFailed(RuntimeError):
    """A server exited or did not become ready; the message holds the end of its log."""


class MpserveServer:
    """``python -m mpserve start …`` with its log read line by line; ready at the "ready:" line."""

    def __init__(self, *args: str) -> None:
        self.name = f"bench{os.getpid()}-{next(_names)}"
        self.log: list[str] = []
        self._ready = threading.Event()
        self.started = time.perf_counter()
        self.ready_at = 0.0
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mpserve", "start", "--server-name", self.name, "--log-level", "info", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=_die_with_parent)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line.rstrip("\n"))
            if "ready:" in line and not self._ready.is_set():
                self.ready_at = time.perf_counter()
                self._ready.set()

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> float:
        """Seconds from starting the process to the "ready:" line (all instances loaded)."""
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.01):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise ServerFailed("mpserve did not become ready:\n" + "\n".join(self.log[-20:]))
        return self.ready_at - self.started

    @property
    def address(self) -> str:
        info = ServerInfo.read(self.name)
        if info is None:
            raise ServerFailed(f"server {self.name} published no info file")
        return info.front

    def worker_pids(self) -> list[int]:
        info = ServerInfo.read(self.name)
        assert info is not None
        rows = SlotTable.read_rows(Path(info.slots))
        return list(dict.fromkeys(row.pid for row in rows if row.pid))  # a row per slot: once each

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5)

    def __enter__(self) -> MpserveServer:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


class HttpServer:
    """A peer HTTP server (llama_cpp.server, llama-server) on a free loopback port."""

    def __init__(self, argv: list[str], port: int, health_path: str) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self._health = self.url + health_path
        self._log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, text=True,
                                     preexec_fn=_die_with_parent)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        if wait_http(self._health, timeout, alive=lambda: self.proc.poll() is None):
            return
        self._log.seek(0)
        log = self._log.read()[-2000:]
        self.stop()
        raise ServerFailed(f"{self.proc.args[0]} did not become ready:\n{log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> HttpServer:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def find_llama_server(given: str | None) -> str | None:
    """The llama-server binary: ``given`` ("" = leave it out), else on PATH, else in LLAMA_SERVER_PLACES."""
    if given is not None:
        return given or None
    found = shutil.which("llama-server")
    if found:
        return found
    for pattern in LLAMA_SERVER_PLACES:
        for path in sorted(glob.glob(pattern)):
            if Path(path).is_file():
                return path
    return None


def wait_http(url: str, timeout: float = READY_TIMEOUT_S, alive: Callable[[], bool] = lambda: True) -> bool:
    """Whether ``url`` answered 200 within ``timeout`` (while ``alive``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and alive():
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return True
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.1)
    return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pss_mib(pid: int) -> float:
    """Proportional set size: private pages plus each shared page divided by its number of mappers."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no Pss line for pid {pid}")


def uss_mib(pid: int) -> float:
    """Unique set size: the pages no other process maps (what stopping the process would free)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:])
    return sum(int(fields[key].split()[0]) for key in ("Private_Clean", "Private_Dirty")) / 1024


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc/PID/task/*/children)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def descendants(pid: int) -> list[int]:
    """Children of ``pid``, their children, and so on (a model's zygote and its workers are grandchildren)."""
    found: list[int] = []
    for child in children(pid):
        found += [child, *descendants(child)]
    return found


def py_spy(pid: int, seconds: float, output: Path, rate: int = 100) -> subprocess.Popen[bytes]:
    """py-spy sampling ``pid`` for ``seconds`` (whole, at least one) ``rate`` times a second without pausing it,
    its collapsed stacks (``--format raw``: ``frame;frame;... count``, innermost last) going to ``output``."""
    return subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--duration", str(max(1, int(seconds))),
                             "--rate", str(rate), "--format", "raw", "--output", str(output), "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def pin_spare_core(server: MpserveServer) -> None:
    """Every thread of ``server``'s workers on the first CPU this process may use, and of its other processes
    (the broker, the gateway, the zygote) on the rest."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise ValueError("pinning leaves a CPU to the serving processes: this process may use only one")
    workers = set(server.worker_pids())
    serving = [server.proc.pid, *(pid for pid in descendants(server.proc.pid) if pid not in workers)]
    for pids, mask in ((workers, cpus[:1]), (serving, cpus[1:])):
        for pid in pids:
            for task in Path(f"/proc/{pid}/task").iterdir():
                os.sched_setaffinity(int(task.name), mask)


class CpuMeter:
    """CPU time (every thread, from the scheduler's nanosecond counters) that some processes, and this one,
    use over a block."""

    def __init__(self, pids: list[int]) -> None:
        self._pids = pids
        self.others_s = 0.0
        self.own_s = 0.0

    def __enter__(self) -> CpuMeter:
        self.others_s, self.own_s = -self._others(), -cpu_seconds(os.getpid())
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.others_s += self._others()
        self.own_s += cpu_seconds(os.getpid())

    def _others(self) -> float:
        return sum(cpu_seconds(pid) for pid in self._pids)


ZMQ_THREADS = "ZMQbg/"
"""How libzmq names its own threads (I/O, reaper)."""


def cpu_seconds(pid: int, *, libzmq: bool = True) -> float:
    """Time on CPU of every live thread of ``pid`` (/proc/PID/task/*/schedstat, nanoseconds); ``libzmq``
    False leaves libzmq's own threads out."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if not libzmq and (task / "comm").read_text().startswith(ZMQ_THREADS):
                continue
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            continue  # the thread ended between listing and reading
    return total / 1e9
