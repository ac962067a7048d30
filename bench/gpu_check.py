"""``python -m bench.gpu_check``: mpserve's GPU coordination on one real GPU, in a few minutes.

    1. instances   N instances of one model on the GPU against 1 instance, both at concurrency N (aggregate
                   tokens/s); beside them one instance with ``--parallel N`` (one batch of N)
    2. exclusive   one instance, one request at a time: ``--gpu-mode exclusive`` (a host-wide permit taken
                   and given back around every request) against ``shared`` (tokens/s ratio)
    3. permits     two servers in exclusive mode on the same GPU under load at once, with one hold log
                   (``permit_log``): the most holds ever open at once (1, or exclusivity failed), the holds
                   of each server, and how much of the time the GPU was held
    4. memory      each instance's placement estimate (from the GGUF) against what NVML says its process
                   holds on the GPU (needs ``pip install 'mpserve[nvml]'``)

Every server is started as a user would (``python -m mpserve start``), one at a time except the two of
part 3, and stopped before the next. The model defaults to the built-in bench model; ``--model`` takes any
GGUF. With no real GPU here, or a llama.cpp build that cannot offload to it (``mpserve doctor``'s check),
the check refuses at once, exit status 2, and says why.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

from mpserve.gpu.devices import Device, detect, format_memory
from mpserve.gpu.memory import memory_by_pid, read_usage
from mpserve.gpu.permits import max_concurrent, read_holds
from mpserve.gpu.placement import estimate_model_memory
from mpserve.llama_build import build_problems, probe_build

from .load import LoadResult, Workload, mpserve_load, mpserve_warm_up
from .procs import MpserveServer

N_CTX = 512


def refusal(gpu: int) -> str | None:
    """Why this host cannot run the check, or None."""
    devices, source = detect()
    if source == "simulated":
        return "simulated GPUs (MPSERVE_SIMULATE_GPUS) cannot be measured; unset it and run on a GPU host"
    if not devices:
        return "no GPU found (NVML, then nvidia-smi): this check measures a real GPU; run it on a GPU host"
    if gpu not in {d.index for d in devices}:
        return f"GPU {gpu} is not on this host; it has {', '.join(f'GPU {d.index} ({d.name})' for d in devices)}"
    problems = build_problems(probe_build(), devices)
    return f"{problems[0].what}; fix: {problems[0].fix}" if problems else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="GGUF file [default: the built-in bench model]")
    parser.add_argument("--gpu", type=int, default=0, help="the GPU's index (mpserve devices) [default: 0]")
    parser.add_argument("--instances", type=int, default=4, help="N for part 1 [default: 4]")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request [default: 64]")
    parser.add_argument("--requests", type=int, default=32, help="requests per measurement [default: 32]")
    parser.add_argument("--budget", type=float, default=20.0,
                        help="seconds after which a measurement sends no new request [default: 20]")
    args = parser.parse_args(argv)
    if args.instances < 2:
        parser.error("--instances must be at least 2")
    why = refusal(args.gpu)
    if why is not None:
        print(f"error: {why}", file=sys.stderr)
        return 2
    from mpserve.models.builtin import builtin_model_path

    model = str(args.model or builtin_model_path("bench"))
    device = next(d for d in detect()[0] if d.index == args.gpu)
    work = Workload(max_tokens=args.max_tokens, n_ctx=N_CTX, min_requests=args.requests, budget_s=args.budget)
    check = _Check(model, device, work, args.instances)
    print(f"# GPU check: {Path(model).name} on gpu{device.index} ({device.name}, "
          f"{format_memory(device.memory_free)} free of {format_memory(device.memory_total)})\n")
    started = time.perf_counter()
    for part in (check.instances, check.exclusive, check.permits, check.memory):
        print("\n".join(part()) + "\n")
    print(f"_{time.perf_counter() - started:.0f} s in all_")
    return 0


class _Check:
    def __init__(self, model: str, device: Device, work: Workload, instances: int) -> None:
        self.model, self.device, self.work, self.n = model, device, work, instances
        self._memory: list[str] = []  # part 4, measured on part 1's N-instance server

    def _args(self, *extra: str) -> list[str]:
        # one llama.cpp thread per instance: with every layer on the GPU the CPU has little to do, and N
        # instances' spinning thread pools must not outnumber the cores
        return ["--model", self.model, "--gpus", str(self.device.index), "--n-ctx", str(N_CTX), "--threads", "1",
                *extra]

    def _measure(self, server: MpserveServer, instances: int, concurrency: int) -> LoadResult:
        server.wait_ready()
        asyncio.run(mpserve_warm_up(server.address, self.work, instances))
        return asyncio.run(mpserve_load(server.address, self.work, concurrency, self.work.requests(concurrency)))

    def instances(self) -> list[str]:
        """Part 1, and part 4 on the N-instance server once it has served."""
        _progress(f"1 instance, then {self.n}, then 1 × parallel {self.n}, at concurrency {self.n}")
        with MpserveServer(*self._args("--instances", "1")) as server:
            one = self._measure(server, 1, self.n)
        with MpserveServer(*self._args("--instances", str(self.n))) as server:
            many = self._measure(server, self.n, self.n)
            self._memory = self._measure_memory(server.worker_pids())
        with MpserveServer(*self._args("--instances", "1", "--parallel", str(self.n))) as server:
            batched = self._measure(server, 1, self.n)
        rows = [("1 instance", one), (f"{self.n} instances", many), (f"1 instance, --parallel {self.n}", batched)]
        return [f"## 1. Instances on one GPU (concurrency {self.n})", "",
                "| server | tokens/s | × 1 instance | latency p50 ms |", "|---|---|---|---|",
                *(f"| {name} | {r.tokens_per_s:.1f} | {r.tokens_per_s / one.tokens_per_s:.2f}× | "
                  f"{r.latency_ms(50):.0f} |" for name, r in rows)]

    def memory(self) -> list[str]:
        return self._memory

    def _measure_memory(self, pids: list[int]) -> list[str]:
        """Part 4: the estimate for one instance against what each worker process holds."""
        estimate = estimate_model_memory(self.model, N_CTX, -1).total
        usage = read_usage()
        lines = ["## 4. Memory per instance: placement estimate against NVML", ""]
        if usage is None:
            return lines + ["skipped: NVML does not answer (pip install 'mpserve[nvml]')"]
        held = memory_by_pid(usage)
        lines += ["| worker pid | estimated | uses | uses ÷ estimated |", "|---|---|---|---|"]
        for pid in sorted(set(pids)):
            uses = held.get(pid)
            lines.append(f"| {pid} | {format_memory(estimate)} | "
                         + ("not listed by NVML | - |" if uses is None else
                            f"{format_memory(uses)} | {uses / estimate:.2f} |"))
        return lines

    def exclusive(self) -> list[str]:
        _progress("one stream: shared, then exclusive")
        with MpserveServer(*self._args("--instances", "1")) as server:
            shared = self._measure(server, 1, 1)
        with MpserveServer(*self._args("--instances", "1", "--gpu-mode", "exclusive")) as server:
            exclusive = self._measure(server, 1, 1)
        return ["## 2. Exclusive mode on one stream", "",
                "| gpu mode | tokens/s | latency p50 ms |", "|---|---|---|",
                f"| shared | {shared.tokens_per_s:.1f} | {shared.latency_ms(50):.0f} |",
                f"| exclusive | {exclusive.tokens_per_s:.1f} | {exclusive.latency_ms(50):.0f} |", "",
                f"exclusive ÷ shared: {exclusive.tokens_per_s / shared.tokens_per_s:.3f}×"]

    def permits(self) -> list[str]:
        _progress("two exclusive servers on one GPU, one hold log")
        with tempfile.TemporaryDirectory(prefix="mpserve-gpu-check-") as tmp:
            log = Path(tmp) / "holds.log"
            config = Path(tmp) / "permits.yaml"
            config.write_text(f"permit_log: {log}\n")
            args = self._args("--config", str(config), "--instances", "2", "--gpu-mode", "exclusive")
            with MpserveServer(*args) as a, MpserveServer(*args) as b:
                for server in (a, b):
                    server.wait_ready()
                    asyncio.run(mpserve_warm_up(server.address, self.work, 2))
                log.unlink(missing_ok=True)  # the warm-up's holds are not part of the measurement
                started = time.monotonic()
                asyncio.run(self._both(a.address, b.address))
                wall = time.monotonic() - started
                pids = [set(a.worker_pids()), set(b.worker_pids())]
            holds = read_holds(log)
        per_server = [sum(1 for h in holds if h.pid in p) for p in pids]
        held = sum(h.end - h.start for h in holds)
        most = max_concurrent(holds)
        return ["## 3. Permits across two servers (exclusive, 2 instances each, concurrency 4 each)", "",
                f"holds: {len(holds)} ({per_server[0]} server A, {per_server[1]} server B); most at once: {most} "
                f"({'exclusive' if most == 1 else 'NOT EXCLUSIVE'}); GPU held {held / wall:.0%} of {wall:.1f} s"]

    async def _both(self, first: str, second: str) -> None:
        await asyncio.gather(*(mpserve_load(a, self.work, 4, self.work.requests(4)) for a in (first, second)))


def _progress(text: str) -> None:
    print(f"[gpu_check] {text}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
