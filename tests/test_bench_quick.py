"""The benchmark harness keeps working: ``python -m bench --quick`` runs every section and reports it, and
``python -m bench.soak`` runs a short soak.

Only the harness is checked (sections, baselines, positive figures, targets evaluated); no speed is
asserted, since figures belong to bench/ and a shared CI machine says nothing about them.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ALWAYS_MEASURED = {"dispatch", "broker", "scaling", "batching", "memory", "startup", "speculation", "adapters"}
MAY_BE_SKIPPED = {"peers", "permits"}  # need optional packages


# two runs, each with half the sections, so that a parallel run of the suite can take them at once
HALVES = {"dispatch": ["dispatch", "broker", "scaling", "peers", "permits", "adapters"],
          "batching": ["batching", "memory", "startup", "speculation"]}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("half", HALVES)
def test_quick_bench_reports_every_section_with_baselines(tmp_path: Path, half: str) -> None:
    # without llama-server, whether or not this machine has one: the same sections run everywhere (its rows are
    # measured by python -m bench itself)
    run = subprocess.run([sys.executable, "-m", "bench", "--quick", "--only", ",".join(HALVES[half]),
                          "--llama-server", "", "--results", str(tmp_path)], cwd=REPO,
                         capture_output=True, text=True, timeout=170)
    assert run.returncode == 0, run.stdout + run.stderr

    report = run.stdout
    assert report.startswith("# mpserve bench (quick)")
    assert "## Targets" in report and "compete for CPU" in report
    titles = {"dispatch": "Dispatch overhead", "broker": "The broker at scale", "scaling": "Scaling", "peers": "Peers",
              "batching": "Batching", "memory": "Memory", "permits": "Permits", "startup": "Start-up",
              "speculation": "Speculation", "adapters": "LoRA adapters"}
    for key in HALVES[half]:
        assert titles[key] in report

    (result,) = tmp_path.glob("bench-*.json")
    data = json.loads(result.read_text())
    sections = {s["key"]: s for s in data["sections"]}
    assert set(sections) == set(HALVES[half])
    assert all(s["error"] is None for s in sections.values())
    for key, section in sections.items():
        if section["skipped"]:
            assert key in MAY_BE_SKIPPED, f"{key} was skipped: {section['skipped']}"
            continue
        assert section["cases"], key
        for case in section["cases"]:
            for figure in case["figures"]:
                assert len(figure["values"]) == len(figure["baseline_values"]) == data["repeat"]
                for number in (figure["median"], figure["baseline_median"], figure["ratio"]):
                    assert math.isfinite(number) and number > 0, (key, case["labels"], figure)
    targets = [t for s in sections.values() for t in s["targets"]]
    # a figure, not a speed: 0 is a legitimate measure (the broker's rate when no step kept its p99 budget)
    assert all(isinstance(t["met"], bool) and math.isfinite(t["measured"]) and t["measured"] >= 0 for t in targets)
    if half == "dispatch":
        assert {t["text"].split(",")[0] for t in targets} >= {"dispatch p50", "one request"}


def test_the_halves_are_every_section() -> None:
    from bench.cli import SECTIONS

    assert sorted(k for keys in HALVES.values() for k in keys) == sorted(SECTIONS)
    assert set(SECTIONS) - MAY_BE_SKIPPED == ALWAYS_MEASURED


@pytest.mark.timeout(120)
def test_the_soak_runs_its_mixed_load_and_checks_its_invariants() -> None:
    run = subprocess.run([sys.executable, "-m", "bench.soak", "--minutes", "0.15", "--warmup", "3", "--kill-every",
                          "3", "--lanes", "2"], cwd=REPO, capture_output=True, text=True, timeout=110)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "every request ended exactly once" in run.stdout
    for row in ("| zmq | stream | done |", "| zmq | cancel |", "| http | hang_up | hung up |",
                "| http | bad | bad_request |", "| broker |", "| gateway |", "| workers ("):
        assert row in run.stdout, run.stdout


@pytest.mark.timeout(120)
def test_the_tenants_bench_prints_each_target_with_its_figure() -> None:
    run = subprocess.run([sys.executable, "-m", "bench.tenants", "--quick", "--seconds", "5"], cwd=REPO,
                         capture_output=True, text=True, timeout=110)
    assert run.returncode == 0, run.stdout + run.stderr
    targets = [line for line in run.stdout.splitlines() if line.startswith("target: ")]
    assert len(targets) == 3 and all(line.endswith(("met: yes", "met: no")) for line in targets), run.stdout


@pytest.mark.timeout(90)
def test_a_bench_killed_mid_run_leaves_no_server_behind(tmp_path: Path) -> None:
    """A bench killed (as a test's timeout kills it) takes its servers with it: none weighs on what runs next."""
    script = ("import sys, time\nfrom bench.procs import MpserveServer\n"
              "server = MpserveServer('--model', 'builtin:tiny')\nserver.wait_ready()\n"
              "print(server.proc.pid, flush=True)\ntime.sleep(600)\n")
    bench = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert bench.stdout is not None
    pid = int(bench.stdout.readline())
    bench.kill()
    bench.wait(10)
    deadline = time.monotonic() + 40
    while _alive(pid):
        assert time.monotonic() < deadline, f"the bench's server (pid {pid}) outlived it"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited (its parent, gone, reaps nothing)
