"""What one acquire+release of a device permit costs, alone and with 4 contender processes,
and how long the device sits idle when the permit passes from one holder to the next.

The baseline is an uncontended ``fcntl.flock`` lock/unlock on a file: the cheapest kernel lock a
process can take, with none of the permit's queueing, records or crash safety. Run::

    python -m bench.permits_bench [n]
"""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from pathlib import Path

from mpserve.gpu.permits import DevicePermits, HoldInterval

CONTENDERS = 4
KEY = "bench-gpu"


def measure_permits(n: int = 20000) -> dict[str, float]:
    """Median and p99 in microseconds; the contended figures pool ``n`` cycles over 4 processes.

    ``handoff`` is the gap between one holder's release and the next holder's start while 4
    processes each hold the permit for 10 ms at a time: the device time lost to each handover.
    """
    with tempfile.TemporaryDirectory(prefix="mpserve-bench-") as scratch:
        lock_dir = Path(scratch)
        alone = _time_permit_cycles(lock_dir, n)
        together, _ = _time_contended(lock_dir, n, hold=0.0)
        _, gaps = _time_contended(lock_dir, 200, hold=0.01)
        flock = _time_flock_cycles(lock_dir / "flock", n)
    figures = {
        "uncontended_median_us": _percentile(alone, 50),
        "uncontended_p99_us": _percentile(alone, 99),
        f"contended{CONTENDERS}_median_us": _percentile(together, 50),
        f"contended{CONTENDERS}_p99_us": _percentile(together, 99),
        "handoff_median_us": _percentile(gaps, 50),
        "handoff_p99_us": _percentile(gaps, 99),
        "flock_median_us": _percentile(flock, 50),
    }
    figures["uncontended_vs_flock"] = figures["uncontended_median_us"] / figures["flock_median_us"]
    return figures


def _time_permit_cycles(lock_dir: Path, n: int) -> list[float]:
    with DevicePermits(KEY, 1, lock_dir) as permits:
        permits.acquire().release()  # open the pooled descriptor outside the timing
        times = []
        for _ in range(n):
            started = time.perf_counter_ns()
            permits.acquire().release()
            times.append((time.perf_counter_ns() - started) / 1000)
    return times


def _time_contended(lock_dir: Path, n: int, hold: float) -> tuple[list[float], list[float]]:
    """Acquire+release times of all contenders, and the gaps between consecutive holds."""
    context = multiprocessing.get_context("spawn")
    results: Queue[tuple[list[float], list[tuple[float, float]]]] = context.Queue()
    start = context.Event()
    contenders = [
        context.Process(target=_contend, args=(lock_dir, n // CONTENDERS, hold, start, results))
        for _ in range(CONTENDERS)
    ]
    for process in contenders:
        process.start()
    start.set()
    times: list[float] = []
    holds: list[tuple[float, float]] = []
    for _ in contenders:
        some_times, some_holds = results.get(timeout=300)
        times += some_times
        holds += some_holds
    for process in contenders:
        process.join()
    holds.sort()
    gaps = [(after[0] - before[1]) * 1e6 for before, after in zip(holds, holds[1:], strict=False)]
    return times, gaps


def _contend(
    lock_dir: Path, n: int, hold: float, start: Event, results: Queue[tuple[list[float], list[tuple[float, float]]]]
) -> None:
    holds: list[HoldInterval] = []
    with DevicePermits(KEY, 1, lock_dir, on_hold=holds.append) as permits:
        permits.acquire().release()
        start.wait()
        holds.clear()
        times = []
        for _ in range(n):
            started = time.perf_counter_ns()
            with permits.acquire():
                if hold:
                    time.sleep(hold)
            times.append((time.perf_counter_ns() - started) / 1000)
    results.put((times, [(h.start, h.end) for h in holds]))


def _time_flock_cycles(path: Path, n: int) -> list[float]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        times = []
        for _ in range(n):
            started = time.perf_counter_ns()
            fcntl.flock(fd, fcntl.LOCK_EX)
            fcntl.flock(fd, fcntl.LOCK_UN)
            times.append((time.perf_counter_ns() - started) / 1000)
    finally:
        os.close(fd)
    return times


def _percentile(values: list[float], percent: int) -> float:
    return statistics.quantiles(values, n=100)[percent - 1]


if __name__ == "__main__":
    for name, value in measure_permits(*(int(arg) for arg in sys.argv[1:])).items():
        print(f"{name:28} {value:10.2f}")
