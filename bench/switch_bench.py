"""How long a single-active-backend switch takes: the resident model unloads and the requested one loads.

Two models share one (simulated) GPU under --single-active-backend. A request for the model that is
already resident is the baseline; a request for the other model pays for the switch. The switch cost is
the difference of their medians, measured in the same run:

    python -m bench.switch_bench [--size tiny|bench] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from mpserve import Client
from mpserve.models.builtin import builtin_model_path


def measure(size: str, rounds: int) -> dict[str, float]:
    path = str(builtin_model_path(size))
    with tempfile.TemporaryDirectory(prefix="mpsw-") as tmp:
        config = Path(tmp) / "switch.yaml"
        config.write_text(yaml.safe_dump({"switch_batch": 1, "models": [
            {"name": "a", "path": path, "n_ctx": 512}, {"name": "b", "path": path, "n_ctx": 512}]}))
        env = {**os.environ, "MPSERVE_RUNTIME_DIR": tmp, "MPSERVE_LOCK_DIR": tmp}
        server = subprocess.Popen([sys.executable, "-m", "mpserve", "start", "--config", str(config),
                                   "--simulate-gpus", "1x24GiB", "--single-active-backend", "--server-name", "sw"],
                                  env=env, stderr=subprocess.PIPE, text=True)
        try:
            assert server.stderr is not None
            for line in server.stderr:
                if "ready:" in line:
                    break
            os.environ["MPSERVE_RUNTIME_DIR"] = tmp
            with Client(server_name="sw", timeout=120) as client:
                def timed(model: str) -> float:
                    started = time.perf_counter()
                    client.generate("switch", model=model, max_tokens=1, temperature=0)
                    return time.perf_counter() - started

                timed("a")
                resident, switching = [], []
                for _ in range(rounds):
                    resident.append(timed("a"))  # a is resident: no switch
                    switching.append(timed("b"))  # a unloads, b loads
                    resident.append(timed("b"))
                    switching.append(timed("a"))
        finally:
            server.terminate()
            server.wait(30)
    base, switch = statistics.median(resident), statistics.median(switching)
    return {"resident_ms": base * 1000, "switching_ms": switch * 1000, "switch_cost_ms": (switch - base) * 1000}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("tiny", "bench"), action="append")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print("| model | request, model resident (ms) | request with a switch (ms) | switch cost (ms) |")
    print("|---|---|---|---|")
    for size in args.size or ["tiny", "bench"]:
        r = measure(size, args.rounds)
        print(f"| {size} | {r['resident_ms']:.1f} | {r['switching_ms']:.1f} | {r['switch_cost_ms']:.1f} |")


if __name__ == "__main__":
    main()
