"""Helpers shared by the tests."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import gguf
import httpx
import numpy as np
import pytest
import yaml
import zmq

from mpserve import AsyncClient, Client
from mpserve.wire import protocol as wire
from mpserve.wire.slots import SlotRow, SlotState

T = TypeVar("T")


def wait_for(condition: Callable[[], T], timeout: float = 10.0, what: str = "the condition",
             interval: float = 0.01) -> T:
    """Poll ``condition`` until it returns something truthy, and return that; fail naming ``what`` after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(interval)
    return value


def http_up(url: str) -> bool:
    """Whether the gateway at ``url`` answers /health with 200 (ready)."""
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def free_port() -> int:
    """A TCP port of 127.0.0.1 that no one listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP has taken effect: its state is T)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def stop(pid: int) -> None:
    """Stop process ``pid`` (SIGSTOP), and return once it has taken effect."""
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: stopped(pid), 10, f"process {pid} to stop")


def far_from_its_end(row: SlotRow, total: int | None) -> bool:
    """Whether ``row``, read with its instance stopped, runs a request that cannot end in the step its instance was
    stopped in: busy, read whole, and more than one token short of ``total`` (one step makes one token). ``total``
    None: the instance takes no step again (it is killed, or kept stopped)."""
    return row.state is SlotState.BUSY and not row.stuck_s and (total is None or row.tokens + 1 < total)


def stopped_instance(slots: Callable[[], list[SlotRow]]) -> int:
    """The pid of a server's one instance, stopped (SIGSTOP has taken effect)."""
    (pid,) = {r.pid for r in slots() if r.pid}
    stop(pid)
    return pid


def stopped_running(slots: Callable[[], list[SlotRow]], request: str, total: int) -> int | None:
    """The pid of a server's one instance, stopped with request ``request`` (its id; a row holds its beginning)
    running far from its end (``far_from_its_end``); None, the instance going on (SIGCONT), where it was not."""
    pid = stopped_instance(slots)
    if any(r.request and request.startswith(r.request) and far_from_its_end(r, total) for r in slots()):
        return pid
    os.kill(pid, signal.SIGCONT)
    return None


def server_idle(observer: Client) -> bool:
    """Whether the server ``observer`` is connected to has no request queued or running."""
    return not any(m.queued + m.running for m in observer.stats().models.values())


def caught_mid_request(slots: Callable[[], list[SlotRow]], total: int | None, ended: Callable[[], bool],
                       timeout: float = 30.0) -> SlotRow | None:
    """Wait until an instance runs a request far from its end (``far_from_its_end``: one of ``total`` tokens),
    and leave that instance stopped (SIGSTOP) there: its row. None where ``ended()`` says the request ended first
    (a poll alone could see it busy and stop its instance after it ended, on a loaded host or a fast one)."""
    deadline = time.monotonic() + timeout
    while not ended():
        for pid in {r.pid for r in slots() if r.state is SlotState.BUSY}:
            stop(pid)
            row = next((r for r in slots() if r.pid == pid and far_from_its_end(r, total)), None)
            if row is not None:
                return row
            os.kill(pid, signal.SIGCONT)
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: an instance running the request")
        time.sleep(0.01)
    return None


def mpserve(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``python -m mpserve ARGS`` run to its end, its output captured; ``env`` on top of this process's. One still
    running after ``timeout`` s fails the test with what each of its threads was doing (Python's faulthandler,
    dumped on SIGABRT) and what it printed."""
    command = [sys.executable, "-m", "mpserve", *args]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})}) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            stdout, stderr = proc.communicate(timeout=30)
            raise AssertionError(f"`mpserve {' '.join(args)}` did not end within {timeout:g} s; its output:\n"
                                 f"{stdout}\nits stderr, with its threads' stacks:\n{stderr}") from None
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


@contextlib.contextmanager
def dealer(address: str, identity: bytes | None = None, **options: int | bytes) -> Iterator[zmq.Socket[bytes]]:
    """A raw DEALER connected to ``address``, in a context of its own (``options``: socket options by name,
    ``SNDHWM=10``, ``CURVE_SECRETKEY=…``); what it sends is not checked as mpserve's clients check it."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    for name, value in options.items():
        sock.setsockopt(getattr(zmq, name), value)
    sock.connect(address)
    try:
        yield sock
    finally:
        sock.close(0)
        ctx.term()


def raw_request(body: dict[str, Any]) -> list[bytes]:
    """The frames of a REQUEST whose body is ``body`` as it is, unchecked."""
    return [wire.VERSION, bytes([wire.MsgType.REQUEST]), wire.pack(body)]


def received(sock: zmq.Socket[bytes], timeout: float = 5.0) -> Any:
    """The next message ``sock`` receives, decoded; fail if none comes within ``timeout`` seconds."""
    assert sock.poll(int(timeout * 1000)), f"no answer within {timeout} s"
    return wire.decode(sock.recv_multipart())


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` (R, S, T, Z…), or None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat[stat.rindex(")") + 2]


def running(pid: int) -> bool:
    """Alive and not a zombie (a killed worker stays a zombie until someone reaps it)."""
    return pid > 0 and process_state(pid) not in (None, "Z")


def ppid(pid: int) -> int:
    """The parent of ``pid``."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))


def children(pid: int) -> list[int]:
    """Direct children of ``pid``."""
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]


def rss_kib(pid: int) -> int:
    """The resident memory of ``pid``, in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


# glibc's thresholds for a process whose resident size a test measures: big buffers go back to the kernel when
# freed, and heaps are trimmed early, so that its RSS is what it holds on to
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(256 * 1024), "MALLOC_TRIM_THRESHOLD_": str(128 * 1024)}


def live_environ(pid: int) -> dict[str, str]:
    """The environment of process ``pid`` as its own ``getenv`` (and the CUDA runtime) reads it now: the C
    ``environ``, read through /proc/PID/mem. /proc/PID/environ holds the one the process was executed with, and
    a worker forked from a fork server sets its variables after that. ``pid`` runs this process's executable."""
    address = ctypes.addressof(ctypes.c_void_p.in_dll(ctypes.CDLL(None), "environ"))
    mine = _mappings("self")
    path = [name for start, name in mine if start <= address][-1]  # libc's, or the executable's own copy
    offset = address - min(start for start, name in mine if name == path)
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        def read(at: int, n: int) -> bytes:
            mem.seek(at)
            return mem.read(n)

        def pointer(at: int) -> int:
            return int.from_bytes(read(at, 8), sys.byteorder)

        env: dict[str, str] = {}
        entry = pointer(min(start for start, name in _mappings(str(pid)) if name == path) + offset)
        while at := pointer(entry):
            text = b""
            while b"\0" not in text:  # to the end of the string, never past the end of its page
                text += read(at + len(text), 4096 - (at + len(text)) % 4096)
            name, _, value = text[:text.index(b"\0")].decode(errors="replace").partition("=")
            env[name] = value
            entry += 8
        return env


def _mappings(pid: str) -> list[tuple[int, str]]:
    """Where each file-backed mapping of process ``pid`` starts, and its file, in address order (the
    anonymous ones, a file's zeroed data among them, lie after theirs)."""
    rows = (line.split() for line in Path(f"/proc/{pid}/maps").read_text().splitlines())
    return [(int(row[0].split("-")[0], 16), row[5]) for row in rows if len(row) > 5 and row[5].startswith("/")]


# a row whose model is in memory or on its way there
LOADED = {SlotState.LOADING, SlotState.IDLE, SlotState.BUSY, SlotState.WAITING}


def config_file(tmp_path: Path, name: str, **values: object) -> str:
    """A config file of ``values`` (``--config``), written in ``tmp_path``."""
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(values))
    return str(path)


async def load(address: str, n: int, max_tokens: int, concurrency: int, models: list[str] | None = None
               ) -> list[object]:
    """``n`` requests, ``concurrency`` at a time, cycling through ``models``; returns results/errors."""
    sem = asyncio.Semaphore(concurrency)
    async with AsyncClient(address, timeout=120) as client:
        async def one(i: int) -> object:
            async with sem:
                model = models[i % len(models)] if models else None
                return await client.generate(f"request {i}", model=model, max_tokens=max_tokens, temperature=0)

        return await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)


CHROMIUM = "/usr/bin/chromium"  # the system's package: the browser tests download no browser
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """Headless Chromium, driven by Playwright (imported here: only the browser tests need it)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield browser
        finally:
            browser.close()


OTHER_USER = 65534  # "nobody": the second local user of the tests that play one


def as_other_user(action: Callable[[], object]) -> str:
    """Run ``action`` in a forked child that dropped to another local user (uid and gid 65534, no other groups),
    as a second user of a shared host would; its outcome: "ok", or the exception's type and text. Only root can
    switch users, and the suite runs as root on CI; elsewhere the test is skipped (tests/allowed_skips.txt)."""
    if os.geteuid() != 0:
        pytest.skip("acting as a second local user needs root (the suite runs as root on CI)")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        try:
            os.setgroups([])
            os.setgid(OTHER_USER)
            os.setuid(OTHER_USER)
            action()
            outcome = "ok"
        except BaseException as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        os.write(write, outcome.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as answer:
        outcome = answer.read().decode()
    os.waitpid(pid, 0)
    return outcome


@contextlib.contextmanager
def shared_place() -> Iterator[Path]:
    """A folder every local user may create names in (sticky and world-writable, like /dev/shm and /tmp)."""
    path = Path(tempfile.mkdtemp(prefix="mpt-shared-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    os.chmod(path, 0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def gguf_with_array(path: Path, count: int) -> Path:
    """The built-in tiny model with one more metadata key, ``x.bigarr``: an array of ``count`` distinct int32 (a
    file of 4 × ``count`` bytes more, that llama.cpp still loads)."""
    from mpserve.models.builtin import builtin_model_path

    whole = builtin_model_path("tiny").read_bytes()
    n_tensors, n_kv = struct.unpack_from("<QQ", whole, 8)
    key = b"x.bigarr"  # 8 bytes: the entry takes a multiple of 32 bytes, so the tensor data stays aligned
    values = np.arange(1000, 1000 + count, dtype="<i4").tobytes()
    entry = struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 5, count) + values  # ARRAY of INT32
    path.write_bytes(whole[:8] + struct.pack("<QQ", n_tensors, n_kv + 1) + entry + whole[24:])
    return path


def write_adapter(path: Path, arch: str = "llama", kind: str = "adapter", lora: str = "lora", rank: int = 4,
                  pairs: dict[str, tuple[int, int]] | None = None) -> Path:
    """An adapter-shaped GGUF: each pair adapts a base tensor of ``(n_in, n_out)`` (ggml's order) at ``rank``."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type(kind)
    writer.add_string("adapter.type", lora)
    writer.add_float32("adapter.lora.alpha", float(rank))
    for name, (n_in, n_out) in (pairs or {"blk.0.attn_q.weight": (64, 64)}).items():
        writer.add_tensor(f"{name}.lora_a", np.zeros((rank, n_in), np.float32))  # numpy order: ne reversed
        writer.add_tensor(f"{name}.lora_b", np.zeros((n_out, rank), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
