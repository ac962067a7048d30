"""Whether llama.cpp may repack a model's weights on this host: a probe in a child process, its verdict cached.

    worker_spec (server, pool) ─▶ repack_for(model)
        repack: true / false (--no-repack) ─────────────────────────▶ as set
        auto (the default), echo ──────────────────────────────────▶ on (echo loads no weights)
        auto, a model ─▶ host_verdict(): once per process
            cached verdict for (this CPU, this kernel, this llama.cpp build)?  ──yes──▶ it
            no ─▶ python -m mpserve.engine.repack_check DIR (a child: a small model, each repacked type, a batch)
                   exit 0 ─────────────▶ works: cached, repacking on
                   killed by a signal ─▶ crashes: cached, repacking off, said once in the log
                   anything else ──────▶ not cached (the probe itself failed), repacking on, a warning

Why: llama.cpp's repacked CPU kernels (AMX, AVX-512) crash on some hosts that advertise them, such as VMs that
report AMX and do not run it. llama-server and llama_cpp.Llama then die at their first decode of several tokens;
mpserve notices before a worker starts and serves the weights as stored. Where they run (the reference machine, an
AMD EPYC with AVX-512 and no AMX), repacking stays on. ``mpserve doctor`` shows the verdict.
The server process never imports llama_cpp: the probe is a child, so a crash there costs nothing but its verdict.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from mpserve import children
from mpserve.config.loader import ECHO_MODEL, ModelConfig
from mpserve.models.builtin import cache_dir

log = logging.getLogger("mpserve.repack")

PROBE_TIMEOUT_S = 120.0
CACHE_VERSION = 1


@dataclass(frozen=True)
class Verdict:
    works: bool  # repacked kernels ran (or could not be tested)
    detail: str  # what the probe saw, in words
    key: str  # the host and build the verdict holds for
    cached: bool = False  # read from the cache rather than probed now

    @property
    def summary(self) -> str:
        if self.works:
            return f"llama.cpp's repacked CPU kernels: {self.detail}"
        return (f"llama.cpp's repacked CPU kernels crash on this host ({self.detail}): models are served without "
                "repacking (repack: true forces it)")


def repack_for(model: ModelConfig) -> bool:
    """Whether ``model``'s instances load with llama.cpp's repacked weight layouts."""
    if model.repack is not None:
        return model.repack
    if model.path == ECHO_MODEL:
        return True
    return host_verdict().works


@functools.cache
def host_verdict() -> Verdict:
    """This host's verdict, probed at most once per process; the first one is logged."""
    verdict = probe()
    if verdict.works:
        log.debug("%s", verdict.summary)
    else:
        log.warning("%s", verdict.summary)
    return verdict


def probe(python: str = sys.executable, cache: Path | None = None, timeout: float = PROBE_TIMEOUT_S) -> Verdict:
    """The cached verdict for this host and build, else a fresh probe (cached unless the probe itself failed)."""
    key = host_key()
    path = (cache or cache_dir()) / f"repack-{key}.json"
    try:
        saved = json.loads(path.read_text())
        if saved.get("version") == CACHE_VERSION:
            return Verdict(bool(saved["works"]), str(saved["detail"]), key, cached=True)
    except (OSError, ValueError, KeyError, AttributeError):
        pass  # none yet, or unreadable: probe again
    verdict, conclusive = _run_probe(python, key, timeout)
    if conclusive:
        _save(path, verdict)
    return verdict


def host_key() -> str:
    """What the verdict depends on: the CPU (model and flags), the kernel, and the llama.cpp build (its
    version and its shared libraries), hashed; llama_cpp is located, not imported."""
    parts = [_cpu_identity(), platform.release(), _llama_build()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _run_probe(python: str, key: str, timeout: float) -> tuple[Verdict, bool]:
    """The probe's verdict and whether it is conclusive (worth caching)."""
    with tempfile.TemporaryDirectory(prefix="mpserve-repack-") as tmp:
        try:
            done = subprocess.run(children.python("-m", "mpserve.engine.repack_check", tmp, executable=python),
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return Verdict(True, f"the probe did not finish within {timeout:g} s; left on", key), False
    tried = [line.split(" ", 1)[1] for line in done.stdout.splitlines() if line.startswith("try ")]
    if done.returncode == 0:
        return Verdict(True, f"ran on this host ({', '.join(tried)} weights)", key), True
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name
        where = f"{tried[-1]} weights" if tried else "the probe"
        return Verdict(False, f"{name} at the first decode of {where}", key), True
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    reason = lines[-1] if lines else f"exit status {done.returncode}"
    return Verdict(True, f"the probe failed ({reason}); left on", key), False


def _save(path: Path, verdict: Verdict) -> None:
    """Atomically: a reader never sees half a verdict. A cache that cannot be written is only a cost."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "w") as out:
            json.dump({"version": CACHE_VERSION, **asdict(verdict), "cached": True}, out)
        os.replace(tmp, path)
    except OSError as exc:
        log.debug("repack verdict not cached in %s: %s", path, exc)


def _cpu_identity() -> str:
    """The first processor's model name and sorted flags from /proc/cpuinfo; elsewhere, what platform says."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    fields = dict(line.split(":", 1) for line in text.split("\n\n", 1)[0].splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = fields.get("flags") or fields.get("Features") or ""
    return f"{fields.get('model name', platform.machine())} {' '.join(sorted(flags.split()))}"


def _llama_build() -> str:
    """llama-cpp-python's version and its shared libraries' names, sizes and times (a rebuild changes them)."""
    try:
        version = importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        version = "absent"
    spec = importlib.util.find_spec("llama_cpp")
    libs = []
    if spec is not None and spec.origin is not None:
        for lib in sorted((Path(spec.origin).parent / "lib").glob("*")):
            st = lib.stat()
            libs.append(f"{lib.name}:{st.st_size}:{st.st_mtime_ns}")
    return f"{version} {' '.join(libs)}"
