"""The reload under load: greedy streams run while ``mpserve reload`` changes a limit, adds a model, removes one
and changes the served model's n_ctx (a roll), and then gives that model another file (a blue/green roll).

    server    mpserve start --config: the model (the built-in one; --gemma: Gemma 3 270M), 4 instances of
              parallel 4, n_ctx 1024, and "old" (the echo backend), which the reload removes
    streams   --streams at once over the Python client, greedy, --tokens each, each started again as it ends
    reload 1  after --settle s: max_queue 256 -> 128, "old" removed, "new" (echo) added, n_ctx 1024 -> 2048;
              then the roll's end is awaited (``mpserve status``: no instance on the previous settings)
    reload 2  the model's file replaced by a copy of it at another path (the same weights: the same texts), and
              its roll awaited; the streams then end
    checked   failed requests by code (target: none); each stream's text against its run alone before the reloads
              (exact under ``reuse: any`` is not promised: the count is printed beside a baseline of the same
              load with no reload); model loads (zygotes that loaded weights: target 1 for the start, 0 for the
              context roll, 1 for the file); each roll's seconds; the longest pause per stream, p50 and p99

    python -m bench.reload                # the built-in model: 16 streams of 300 tokens
    python -m bench.reload --gemma        # Gemma 3 270M, 8 streams
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import yaml

from mpserve import Client
from mpserve.errors import MpserveError
from mpserve.models.builtin import default_model_path

from .failover import Outcome, Process, _gemma, _quantile

LOADED = "instances are forked from here"


class Run:
    def __init__(self, args: argparse.Namespace, folder: Path) -> None:
        self.args, self.folder = args, folder
        self.name = f"reload{os.getpid()}"
        self.config = folder / "pool.yaml"
        path = _gemma() if args.gemma else str(default_model_path())
        self.model = {"name": "m", "path": path, "instances": 4, "parallel": 4, "n_ctx": 1024}
        self.write(max_queue=256, models=[self.model, {"name": "old", "path": "echo"}])
        self.server = Process([sys.executable, "-m", "mpserve", "start", "--server-name", self.name, "--config",
                               str(self.config), "--log-level", "info"])
        self.stop = threading.Event()

    def write(self, **config: object) -> None:
        self.config.write_text(yaml.safe_dump({"spare_slots": 4, **config}))

    def reload(self) -> list[str]:
        answer = subprocess.run([sys.executable, "-m", "mpserve", "reload", "--server-name", self.name],
                                capture_output=True, text=True, timeout=60)
        if answer.returncode:
            raise RuntimeError(f"reload refused: {answer.stderr.strip()}")
        return [line for line in answer.stdout.splitlines() if line.startswith(("max_queue", "models["))]

    def rolled(self, timeout: float = 600.0) -> float:
        """Seconds until ``mpserve status`` shows no instance of the model on the previous settings."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            status = subprocess.run([sys.executable, "-m", "mpserve", "status", "--server-name", self.name],
                                    capture_output=True, text=True, timeout=30).stdout
            if "model m:" in status and "rolling" not in status:
                return time.monotonic() - t0
            time.sleep(0.25)
        raise RuntimeError("the roll did not end")

    def loads(self) -> int:
        return sum(LOADED in line for line in self.server.log)

    def prompts(self) -> list[str]:
        return [f"Once upon a time, story {i}:" for i in range(self.args.streams)]

    def one(self, client: Client, prompt: str) -> Outcome:
        out = Outcome("zeromq")
        try:
            for piece in client.stream(prompt, model="m", max_tokens=self.args.tokens, temperature=0, timeout=600):
                out.add(piece)
        except MpserveError as exc:
            out.error = exc.code
        return out

    def keep_streaming(self, prompt: str, index: int, ran: list[tuple[int, Outcome]]) -> None:
        with Client(server_name=self.name, timeout=600) as client:
            while not self.stop.is_set():
                ran.append((index, self.one(client, prompt)))

    def phase(self, during: float | None) -> tuple[list[tuple[int, Outcome]], dict[str, object]]:
        """Every stream run until the reloads are over (``during`` None) or for ``during`` s: what they gave, and
        what the reloads said and measured."""
        ran: list[tuple[int, Outcome]] = []
        self.stop.clear()
        threads = [threading.Thread(target=self.keep_streaming, args=(p, i, ran)) for i, p in enumerate(self.prompts())]
        for t in threads:
            t.start()
        seen: dict[str, object] = {}
        try:
            time.sleep(self.args.settle)
            if during is not None:
                time.sleep(during)
            else:
                seen["loads before"] = self.loads()
                self.write(max_queue=128, models=[{**self.model, "n_ctx": 2048}, {"name": "new", "path": "echo"}])
                seen["reload 1"] = self.reload()
                seen["context roll s"] = self.rolled()
                seen["loads after the context roll"] = self.loads()
                other = self.folder / "other.gguf"
                shutil.copyfile(self.model["path"], other)
                self.write(max_queue=128, models=[{**self.model, "n_ctx": 2048, "path": str(other)},
                                                  {"name": "new", "path": "echo"}])
                seen["reload 2"] = self.reload()
                seen["file roll s"] = self.rolled()
                seen["loads after the file roll"] = self.loads()
                with Client(server_name=self.name, timeout=60) as client:
                    seen["new answers"] = bool(client.generate("hello", model="new", max_tokens=4).text)
        finally:
            self.stop.set()
            for t in threads:
                t.join()
        return ran, seen


def report(references: list[str], name: str, ran: list[tuple[int, Outcome]]) -> bool:
    failed = Counter(o.error for _, o in ran if o.error is not None)
    exact = sum(o.error is None and o.text == references[i] for i, o in ran)
    pauses = [o.pause for _, o in ran]
    print(f"{name}: {len(ran)} streams, {exact} exact, {sum(failed.values())} failed "
          f"{dict(failed) if failed else ''}; longest pause p50 {_quantile(pauses, 0.5):.2f} s, "
          f"p99 {_quantile(pauses, 0.99):.2f} s")
    return not failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.reload", description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=None, help="streams at once (16; 8 with --gemma)")
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--settle", type=float, default=5.0, help="seconds of load before the first reload")
    parser.add_argument("--baseline", type=float, default=20.0, help="seconds of the same load with no reload")
    parser.add_argument("--gemma", action="store_true", help="Gemma 3 270M instead of the built-in model")
    args = parser.parse_args(argv)
    args.streams = args.streams or (8 if args.gemma else 16)
    with tempfile.TemporaryDirectory() as folder:
        run = Run(args, Path(folder))
        run.server.start()
        try:
            deadline = time.monotonic() + 300
            while not any("ready:" in line for line in run.server.log):
                if time.monotonic() > deadline or (run.server.proc and run.server.proc.poll() is not None):
                    raise RuntimeError("the server did not start:\n" + "\n".join(run.server.log[-20:]))
                time.sleep(0.05)
            with Client(server_name=run.name, timeout=600) as client:
                references = [client.generate(p, model="m", max_tokens=args.tokens, temperature=0).text
                              for p in run.prompts()]
            quiet, _ = run.phase(args.baseline)
            loud, seen = run.phase(None)
        finally:
            run.server.stop()
    print(f"python -m bench.reload: {'Gemma 3 270M' if args.gemma else 'the built-in model'}, {args.streams} "
          f"greedy streams of {args.tokens} tokens, 4 instances of parallel 4")
    ok = report(references, "baseline (no reload)", quiet)
    ok = report(references, "under the reloads", loud) and ok
    for key, value in seen.items():
        print(f"  {key}: {value:.1f}" if isinstance(value, float) else f"  {key}: {value}")
    loads_ok = seen["loads before"] == seen["loads after the context roll"] == 1 and \
        seen["loads after the file roll"] == 2
    print(f"targets: no request failed {'met' if ok else 'MISSED'}; no model loaded by the context roll, one by the "
          f"file roll {'met' if loads_ok else 'MISSED'}")
    return 0 if ok and loads_ok else 1


if __name__ == "__main__":
    sys.exit(main())
