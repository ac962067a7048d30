"""Tenants: fair shares of one model's slots, and one tenant's flood kept off another's time to first token.

    fairness    3 tenants of weights 1 : 2 : 4 (the server's ``tenants`` section), each keeping 16 requests
                queued on one model (16 plus the slots in flight, sent again as each ends), for ``--seconds``;
                the generated tokens of the requests that ended after a warm-up, per tenant.
                Target: each tenant's share within ±10 % of its weight's (1/7, 2/7, 4/7).
    isolation   one tenant floods 500 requests at once; another sends one request at a time: its time to first
                token (streamed, median) against the same requests on the idle server (before the flood and after
                it), and its refusals.
                The tenants' default entry has ``max_running`` one less than the slots, so a flood leaves one slot
                for the others. Target: TTFT ≤ 2× idle, and no 429 (ERROR ``busy``) for the other tenant.
    priority    (``bench.priority``) a batch tenant keeps every slot of one instance busy and 32 queued; an
                interactive request at priority 10 preempts one: its TTFT p50 against the idle server's.
                Target: ≤ 1.5× idle.

Both through the server's admin socket, each request naming its tenant (as the gateway does for each API key).
Greedy, ``ignore_eos``: every request generates its ``max_tokens``.

    python -m bench.tenants            # bench model, 60 s of fairness
    python -m bench.tenants --quick    # the built-in tiny model, shorter: a minute or two
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from mpserve import AsyncClient
from mpserve.errors import Busy
from mpserve.runtime import ServerInfo

from . import priority
from .procs import MpserveServer

WEIGHTS = {"key:" + "1" * 16: 1, "key:" + "2" * 16: 2, "key:" + "4" * 16: 4}
QUEUED = 16  # requests each tenant keeps queued
SHARE_TOLERANCE = 0.10
FLOOD = 500
FLOODER = "key:" + "f" * 16
OTHER = "key:" + "0" * 16
PROBES = 8  # the other tenant's requests, one at a time
TTFT_TARGET = 2.0


@dataclass(frozen=True)
class Setup:
    model: str
    instances: int
    parallel: int
    tokens: int
    seconds: float

    @property
    def slots(self) -> int:
        return self.instances * self.parallel


def server(setup: Setup, tenants: Mapping[str, object], folder: Path) -> MpserveServer:
    config = folder / f"tenants-{len(tenants)}.yaml"
    config.write_text(yaml.safe_dump({
        "max_pending_per_client": 2 * FLOOD, "max_queue": 2 * FLOOD, "tenants": dict(tenants),
        "models": [{"name": "m", "path": setup.model, "instances": setup.instances, "parallel": setup.parallel,
                    "threads": 1, "n_ctx": 512}]}))
    return MpserveServer("--config", str(config))


def admin_address(name: str) -> str:
    info = ServerInfo.read(name)
    assert info is not None and info.admin, "the server published no admin socket"
    return info.admin


async def fairness(address: str, setup: Setup) -> dict[str, int]:
    """Generated tokens per tenant of the requests that ended after the warm-up (a fifth of the run)."""
    tokens = dict.fromkeys(WEIGHTS, 0)
    start = time.monotonic()
    warm, end = start + setup.seconds / 5, start + setup.seconds

    async with AsyncClient(address, timeout=600) as client:
        async def lane(tenant: str, lane_index: int) -> None:
            i = 0
            while time.monotonic() < end:
                result = await client.generate(f"{tenant} {lane_index} {i}", max_tokens=setup.tokens,
                                               temperature=0, ignore_eos=True, tenant=tenant)
                i += 1
                if warm <= time.monotonic() <= end:
                    tokens[tenant] += result.usage.completion_tokens

        await asyncio.gather(*(lane(t, j) for t in WEIGHTS for j in range(QUEUED + setup.slots)))
    return tokens


async def ttfts(client: AsyncClient, setup: Setup, label: str) -> tuple[list[float], int]:
    """PROBES streamed requests of the other tenant, one at a time: their times to first text, and refusals."""
    seconds, refused = [], 0
    for i in range(PROBES):
        started = time.perf_counter()
        try:
            stream = client.stream(f"{label} probe {i}", max_tokens=setup.tokens, temperature=0, ignore_eos=True,
                                   tenant=OTHER)
            first = 0.0
            async for _ in stream:
                first = first or time.perf_counter() - started
            seconds.append(first)
        except Busy:
            refused += 1
    return seconds, refused


async def isolation(address: str, setup: Setup) -> tuple[float, float, int, int]:
    """The other tenant's median TTFT idle (before the flood and after it, so that a change in the host's own load
    weighs on both) and under the flood, its refusals, and the flood's requests done."""
    async with AsyncClient(address, timeout=3600) as client:
        await ttfts(client, setup, "warm-up")  # every instance past its first requests
        idle, _ = await ttfts(client, setup, "idle")
        flood = [asyncio.ensure_future(client.generate(f"flood {i}", max_tokens=setup.tokens, temperature=0,
                                                        ignore_eos=True, tenant=FLOODER)) for i in range(FLOOD)]
        while (await client.stats()).models["m"].queued < FLOOD // 2 and not all(f.done() for f in flood):
            await asyncio.sleep(0.05)
        loaded, refused = await ttfts(client, setup, "flooded")
        for f in flood:
            f.cancel()
        done = sum(1 for f in flood if f.done() and not f.cancelled() and f.exception() is None)
        await asyncio.gather(*flood, return_exceptions=True)
        while (await client.stats()).models["m"].running:
            await asyncio.sleep(0.05)  # the flood's requests cancelled
        idle += (await ttfts(client, setup, "idle again"))[0]
    return statistics.median(idle), statistics.median(loaded) if loaded else float("inf"), refused, done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0, help="how long the fairness run lasts")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    setup = Setup("builtin:tiny", 2, 2, 16, min(args.seconds, 40.0)) if args.quick else \
        Setup("builtin:bench", 2, 2, 32, args.seconds)
    print(f"{setup.model}, {setup.instances} instances × parallel {setup.parallel}, {setup.tokens} tokens per "
          f"request, greedy; load average (1 min) {os.getloadavg()[0]:.1f} at the start")
    with tempfile.TemporaryDirectory() as tmp:
        with server(setup, {t: {"weight": w} for t, w in WEIGHTS.items()}, Path(tmp)) as fair:
            fair.wait_ready()
            tokens = asyncio.run(fairness(admin_address(fair.name), setup))
        total, weight_sum = sum(tokens.values()), sum(WEIGHTS.values())
        shares = {t: (tokens[t] / total) / (w / weight_sum) if total else 0.0 for t, w in WEIGHTS.items()}
        met = all(abs(s - 1) <= SHARE_TOLERANCE for s in shares.values())
        print(f"fairness, {setup.seconds:.0f} s, {QUEUED} queued per tenant: generated tokens "
              + " : ".join(f"{tokens[t]} (weight {w})" for t, w in WEIGHTS.items()))
        print(f"target: each tenant's share of the tokens within ±{SHARE_TOLERANCE:.0%} of its weight's; measured: "
              + ", ".join(f"{s:.3f}× of weight {WEIGHTS[t]}'s" for t, s in shares.items())
              + f"; met: {'yes' if met else 'no'}")
        slots_left = {"default": {"max_running": setup.slots - 1}}
        with server(setup, slots_left, Path(tmp)) as shared:
            shared.wait_ready()
            idle, loaded, refused, done = asyncio.run(isolation(admin_address(shared.name), setup))
    ratio = loaded / idle
    print(f"load average (1 min) {os.getloadavg()[0]:.1f} after the fairness and isolation runs")
    print(f"isolation, {FLOOD} requests of one tenant at once (max_running {setup.slots - 1} of {setup.slots} "
          f"slots), {done} of them done meanwhile: the other tenant's TTFT p50 {loaded * 1000:.1f} ms, idle "
          f"{idle * 1000:.1f} ms")
    print(f"target: TTFT ≤ {TTFT_TARGET:.0f}× idle; measured: {ratio:.2f}×; met: "
          f"{'yes' if ratio <= TTFT_TARGET else 'no'}")
    print(f"target: the other tenant never refused (429); measured: {refused} of {PROBES} refused; met: "
          f"{'yes' if refused == 0 else 'no'}")
    print("priority: a batch tenant keeps every slot busy and 32 queued; an interactive request at priority 10")
    priority.report(setup.model, setup.parallel, 32, 9 if args.quick else 15, 8, 4096 if args.quick else 1024,
                    os.cpu_count() or 1)


if __name__ == "__main__":
    main()
