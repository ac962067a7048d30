"""``python -m bench.fuzz --deep``: the gateway's OpenAPI fuzz (``tests/test_openapi.py``) drawn at random, round
after round, for as long as it is told; each case that failed, printed ready to go into the regressions file.

    round: MPSERVE_OPENAPI_SEED (random), MPSERVE_OPENAPI_EXAMPLES (--examples), MPSERVE_OPENAPI_LOG (a file)
      python -m pytest tests/test_openapi.py -k fuzzed   (its own mpserve start --http, as in the suite)
        -> a JSON line per case sent; the whole request, what failed and a curl line where one failed
    the next round with a new seed, until --minutes have passed: the round running then is told by
    MPSERVE_OPENAPI_UNTIL (each operation skips the rest of its cases; schemathesis runs the operations as
    subtests, and an interrupt would end only the current one); its process group SIGKILL after WIND_DOWN_S
    -> the rounds (seed, cases, failures, exit status) and the cases tried; each distinct failure (operation,
       status, what failed) once, with its smallest request: an entry for tests/data/openapi_regressions.json
       and a curl line

Without ``--deep``: one round of the suite's own draws (derandomized, the suite's examples per operation).
Exit status 1 when a case failed, or a round failed without a case (a traceback in the server's log, say).

    python -m bench.fuzz --deep --minutes 30 [--examples 1000] [--logs DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
REGRESSIONS = "tests/data/openapi_regressions.json"
WIND_DOWN_S = 60.0  # after the deadline, how long a round has to stop before SIGKILL (a case waits 30 s at most)


@dataclass
class Round:
    seed: int | None
    log: Path
    output: Path
    status: int = 0
    stopped: bool = False  # by the deadline
    lines: list[dict[str, Any]] = field(default_factory=list)

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [line for line in self.lines if "failure" in line]


def run_round(seed: int | None, examples: int | None, logs: Path, number: int, deadline: float | None) -> Round:
    """One pytest run of the fuzz test, told to stop at ``deadline`` (time.time()); SIGKILL to its process group
    WIND_DOWN_S later."""
    done = Round(seed, logs / f"round{number}.jsonl", logs / f"round{number}.out")
    env = {**os.environ, "MPSERVE_OPENAPI_LOG": str(done.log)}
    if seed is not None:
        env["MPSERVE_OPENAPI_SEED"] = str(seed)
    if examples is not None:
        env["MPSERVE_OPENAPI_EXAMPLES"] = str(examples)
    if deadline is not None:
        env["MPSERVE_OPENAPI_UNTIL"] = str(deadline)
    with done.output.open("w") as output:
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "tests/test_openapi.py", "-k", "fuzzed", "-q",
                                 "-p", "no:cacheprovider"], cwd=ROOT, env=env, stdout=output,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            done.status = proc.wait(None if deadline is None else deadline + WIND_DOWN_S - time.time())
        except (subprocess.TimeoutExpired, KeyboardInterrupt) as stop:
            os.killpg(proc.pid, signal.SIGKILL)  # the round, its server and the server's workers
            done.status = proc.wait()
            if isinstance(stop, KeyboardInterrupt):
                raise
    done.stopped = deadline is not None and time.time() >= deadline
    if done.log.exists():
        done.lines = [json.loads(line) for line in done.log.read_text().splitlines() if line.endswith("}")]
    return done


def findings(rounds: list[Round]) -> dict[tuple[str, str, Any, str], list[tuple[Round, dict[str, Any]]]]:
    """The failed cases by (method, path, status, what failed), smallest request first."""
    found: dict[tuple[str, str, Any, str], list[tuple[Round, dict[str, Any]]]] = {}
    for done in rounds:
        for line in done.failed:
            request = line["request"]
            found.setdefault((request["method"], request["path"], line["status"], line["failure"]), []).append(
                (done, line))
    for cases in found.values():
        cases.sort(key=lambda pair: len(json.dumps(pair[1]["request"])))
    return found


def entry(key: tuple[str, str, Any, str], line: dict[str, Any]) -> dict[str, Any]:
    """A regressions-file entry for the case ``line``; ``fixed_by`` is left for the commit that fixes it."""
    method, path, status, failure = key
    request = line["request"]
    digest = hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()[:8]
    slug = path.strip("/").replace("/", "-").replace("{", "").replace("}", "")
    return {"id": f"{method.lower()}-{slug}-{status or 'no-answer'}-{digest}",
            "found": f"{status or 'no answer'}: {failure}: {line['detail']}", "fixed_by": "COMMIT",
            "request": request}


def report(rounds: list[Round], minutes: float) -> int:
    tried = sum(len(done.lines) for done in rounds)
    print(f"\n# fuzz: {len(rounds)} round(s) in {minutes:.1f} min, {tried} cases tried, "
          f"{sum(len(done.failed) for done in rounds)} failed")
    for i, done in enumerate(rounds, 1):
        statuses = Counter(line["status"] for line in done.lines if "failure" not in line)
        print(f"round {i}: seed {'derandomized' if done.seed is None else done.seed}, {len(done.lines)} cases "
              f"({', '.join(f'{n} × {s}' for s, n in sorted(statuses.items(), key=str))}), {len(done.failed)} "
              f"failed, exit {done.status}{' (stopped at the deadline)' if done.stopped else ''}")
    broken = [done for done in rounds if not done.failed and done.status != 0]
    for done in broken:
        tail = done.output.read_text().splitlines()[-40:]
        print(f"\n## round with seed {done.seed} failed (exit {done.status}) without a failed case; its output "
              f"ends:\n" + "\n".join(tail))
    found = findings(rounds)
    for key, cases in found.items():
        smallest_round, smallest = cases[0]
        print(f"\n## {key[0]} {key[1]}: {key[2] or 'no answer'}, {key[3]} ({len(cases)} case(s), seed(s) "
              f"{', '.join(sorted({str(done.seed) for done, _ in cases}))}); the smallest, for {REGRESSIONS}:")
        print(json.dumps(entry(key, smallest), indent=2, ensure_ascii=False))
        print(smallest["curl"])
    return 1 if found or broken else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--deep", action="store_true",
                        help="random draws, round after round, until --minutes have passed [default: one round of "
                             "the suite's fixed draws]")
    parser.add_argument("--minutes", type=float, default=30.0, help="how long --deep runs [default: 30]")
    parser.add_argument("--examples", type=int, default=1000,
                        help="examples per operation in each --deep round [default: 1000]")
    parser.add_argument("--logs", type=Path, help="where each round's case log and output go [default: a new "
                                                  "temporary directory]")
    args = parser.parse_args(argv)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="mpserve-fuzz-"))
    logs.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    rounds: list[Round] = []
    if not args.deep:
        rounds.append(run_round(None, None, logs, 1, None))
    else:
        deadline = time.time() + args.minutes * 60
        seeds = random.SystemRandom()
        while time.time() < deadline:
            seed = seeds.randrange(2**32)
            print(f"round {len(rounds) + 1}: seed {seed}, {args.examples} examples per operation", flush=True)
            rounds.append(run_round(seed, args.examples, logs, len(rounds) + 1, deadline))
            print(f"  {len(rounds[-1].lines)} cases, {len(rounds[-1].failed)} failed, exit {rounds[-1].status}",
                  flush=True)
            if not rounds[-1].lines and rounds[-1].status != 0:
                break  # not one case sent: the next round would fail the same way
    print(f"logs: {logs}")
    return report(rounds, (time.monotonic() - start) / 60)


if __name__ == "__main__":
    sys.exit(main())
