"""Start-up: from running ``mpserve start`` to all instances ready, against loading the model directly.

mpserve is timed from starting its process to the "ready:" log line, which the server writes once every
instance has loaded its model (and run a 2-token warm-up decode) and registered with the broker. The
baseline is a fresh Python process that imports llama_cpp, constructs ``llama_cpp.Llama`` and runs the
same 2-token warm-up, timed from starting the process to its "loaded" line: what a script that loads the
model itself pays before it can answer its first request at full speed.
"""

from __future__ import annotations

import subprocess
import sys
import time

from .figures import Case, Figure, Section
from .procs import MpserveServer
from .settings import Settings

INSTANCES = (1, 4)
_DIRECT = """
import sys, time
started = time.perf_counter()
import llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=int(sys.argv[2]), n_threads=1, flash_attn=True, verbose=False)
constructed = time.perf_counter() - started
llm.create_completion("warm up", max_tokens=2, temperature=0)
print("loaded", constructed, flush=True)
"""


def run(settings: Settings) -> Section:
    section = Section("startup", "Start-up: process start to all instances ready",
                      "a fresh Python process: import llama_cpp, construct llama_cpp.Llama, 2-token warm-up")
    cases = {n: Case({"instances": str(n)}, [Figure("time to ready", "s")]) for n in INSTANCES}
    n_ctx = str(settings.work.n_ctx)
    _direct_load(settings, n_ctx)  # the model file into the page cache, untimed
    in_process: list[float] = []
    for _ in range(settings.repeat):
        direct, constructor = _direct_load(settings, n_ctx)
        in_process.append(constructor)
        for n in INSTANCES:
            with MpserveServer("--model", str(settings.model), "--instances", str(n), "--n-ctx", n_ctx) as server:
                cases[n].figures[0].add(server.wait_ready(), direct)
    section.cases = list(cases.values())
    section.notes.append(f"Page cache warm. Inside the baseline process, import + Llama() took "
                         f"{sorted(in_process)[len(in_process) // 2]:.2f} s (median) of its total. mpserve's "
                         f"workers start in parallel on {settings.cores} cores.")
    return section


def _direct_load(settings: Settings, n_ctx: str) -> tuple[float, float]:
    """Seconds from starting the process to "loaded", and the part of it spent on import + Llama()."""
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _DIRECT, str(settings.model), n_ctx], capture_output=True,
                         text=True, check=True, timeout=120)
    wall = time.perf_counter() - started
    return wall, float(out.stdout.split()[-1])
