"""The web console: one page at ``GET /`` (and ``/console``) that polls ``GET /console/state`` once a second.

    gateway sampler, every 0.5 s ──▶ Console.observe(slot table)   per slot: time in its state, tokens/s
                                        │                           per model: tokens generated so far
                                        └─ Activity: samples of those totals and of the gateway's outcome
                                           counters, from which come the tokens/s series and the outcomes
                                           of the last minutes
    GET /console/state ──▶ STATS (queues, remote pools) + slot table + Activity + GPUs and permits ──▶ JSON
    GET /, /console, /static/console.{css,js} ──▶ the files in mpserve/gateway/ops/static (plain HTML, CSS, JavaScript)

The page and its files hold no data and are served without the API key; the state is behind the key like
every other route (the gateway's middleware), so without the key the page shows nothing but its key prompt. A
keyed caller's state shows its own requests (ids, tokens, rates) and of other tenants' slots only that they are
busy; the admin key's shows every request (``monitor.Viewer``).
The page polls rather than listening to server-sent events: EventSource cannot send an ``Authorization``
header, so the key would have to travel in the URL, which access logs keep.

Tokens per second come from the slot table when the server runs on this host (every client's tokens, as
they are generated); for a server elsewhere, from the requests completed through this gateway. Outcomes are
the HTTP requests through this gateway by code (``ok`` or the stable error code). GPUs are shown for a
server on this host only: those this process discovers (as ``mpserve devices`` does: NVML, nvidia-smi, or
``$MPSERVE_SIMULATE_GPUS``), with the permits in ``$MPSERVE_LOCK_DIR``, holders matched to slots by pid.
"""

from __future__ import annotations

import asyncio
import bisect
import math
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import Counter
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from mpserve.errors import ConfigError
from mpserve.gpu.devices import Device, discover
from mpserve.gpu.permits import inspect
from mpserve.models.progress import downloads
from mpserve.wire import protocol as wire
from mpserve.wire.slots import SlotRow, SlotState, instance_slots

from ..backend import Backend, LocalSlots
from .metrics import GatewayMetrics
from .monitor import Viewer, state_of, viewer_of

STATIC_DIR = Path(__file__).with_name("static")
FILES = {"console.css": "text/css", "console.js": "text/javascript", "favicon.svg": "image/svg+xml"}
ICON = "/favicon.ico"  # where a browser asks for a site's icon, of any page it shows: the console's, as SVG
PAGE_PATHS = frozenset({"/", "/console", ICON, *(f"/static/{name}" for name in FILES)})  # served without the key
SERIES_STEP_S = 2.0  # one point of a tokens/s series ...
SERIES_POINTS = 60  # ... and how many
OUTCOME_WINDOW_S = 300.0
DEVICES_TTL_S = 2.0  # discovery runs NVML or nvidia-smi: at most this often
MIN_RATE_S = 0.25  # a request seen generating for less time than this has no tokens/s (yet)


@dataclass
class _SlotTrack:
    """One slot as last sampled."""

    pid: int
    state: str
    since: float  # when it entered its state, as near as the samples tell (unix time)
    request: str
    tokens: int
    started: float  # when the current request was first seen (unix time) ...
    started_tokens: int  # ... and its tokens then: its rate counts from there


@dataclass(frozen=True)
class _Sample:
    at: float  # unix time
    local: bool  # tokens from the slot table (else from the requests completed through the gateway)
    tokens: dict[str, float]  # model -> tokens generated so far
    outcomes: dict[str, float]  # code -> HTTP requests ended so far


class Activity:
    """What changes between samples: each slot's state and request, the tokens generated per model, the
    gateway's outcome counters. Kept for as long as the longest view needs (the outcome window)."""

    def __init__(self, metrics: GatewayMetrics, now: float) -> None:
        self._metrics = metrics
        self._slots: dict[int, _SlotTrack] = {}
        self._generated: dict[str, float] = {}  # model -> tokens seen in the slot table
        self._samples: deque[_Sample] = deque([_Sample(now, False, {}, {})])

    def observe(self, rows: list[SlotRow] | None, now: float) -> None:
        if rows is not None:
            for row in rows:
                self._track(row, now)
            present = {r.index for r in rows if r.state is not SlotState.EMPTY}
            for index in set(self._slots) - present:
                del self._slots[index]
        tokens = dict(self._generated) if rows is not None else _totals(self._metrics.generated_tokens, "model")
        self._samples.append(_Sample(now, rows is not None, tokens, _totals(self._metrics.requests, "code")))
        while len(self._samples) > 2 and self._samples[1].at <= now - OUTCOME_WINDOW_S:
            self._samples.popleft()

    def _track(self, row: SlotRow, now: float) -> None:
        if row.state is SlotState.EMPTY:
            return
        state = state_of(row)
        known = self._slots.get(row.index)
        if known is None:  # first sight: its tokens so far are not counted (they may be old)
            self._slots[row.index] = _SlotTrack(row.pid, state, min(row.progress, now) or now, row.request,
                                                row.tokens, now, row.tokens)
            return
        if row.pid != known.pid or row.request != known.request or row.tokens < known.tokens:
            # a new request (or a new worker) since the last sample: all its tokens are new
            generated = row.tokens
            known.pid, known.request, known.started, known.started_tokens = row.pid, row.request, now, row.tokens
        else:
            generated = row.tokens - known.tokens
        known.tokens = row.tokens
        if generated:
            self._generated[row.model] = self._generated.get(row.model, 0) + generated
        if state != known.state:
            known.state, known.since = state, now

    def slot(self, row: SlotRow, now: float) -> tuple[float | None, float | None]:
        """(seconds in its current state, tokens/s of its current or last request), where known."""
        known = self._slots.get(row.index)
        if known is None:
            return None, None
        if row.request != known.request:  # newer than the last sample: no rate yet
            return round(now - known.since, 1), None
        generating_s, tokens = row.progress - known.started, row.tokens - known.started_tokens
        rate = tokens / generating_s if generating_s >= MIN_RATE_S and tokens > 0 else None
        return round(now - known.since, 1), None if rate is None else round(rate, 1)

    def series(self, model: str, now: float) -> list[float | None]:
        """Tokens/s of ``model`` over each of the last SERIES_POINTS whole steps (steps start at multiples of
        SERIES_STEP_S, so a point keeps its value from one poll to the next; None before the first sample),
        from the samples nearest the step boundaries: exact averages over steps of slightly varying length."""
        times = [s.at for s in self._samples]
        last_end = math.floor(now / SERIES_STEP_S) * SERIES_STEP_S
        out: list[float | None] = []
        for j in range(SERIES_POINTS):
            begin = bisect.bisect_right(times, last_end - (SERIES_POINTS - j) * SERIES_STEP_S) - 1
            end = bisect.bisect_right(times, last_end - (SERIES_POINTS - j - 1) * SERIES_STEP_S) - 1
            first, last = self._samples[begin], self._samples[end]
            if begin < 0 or end <= begin or first.local != last.local:  # no samples, or two sources
                out.append(None)
                continue
            tokens = last.tokens.get(model, 0) - first.tokens.get(model, 0)
            out.append(round(max(0.0, tokens) / (last.at - first.at), 1))
        return out

    def outcomes(self, now: float) -> tuple[float, dict[str, int]]:
        """(the seconds covered, HTTP requests ended per code within them, up to now): at most
        OUTCOME_WINDOW_S, counted from the sample at its start."""
        first = self._samples[0]
        for sample in self._samples:
            if sample.at > now - OUTCOME_WINDOW_S:
                break
            first = sample
        counts = {code: int(n - first.outcomes.get(code, 0))
                  for code, n in _totals(self._metrics.requests, "code").items()}
        return round(now - first.at, 1), {code: n for code, n in sorted(counts.items()) if n > 0}


def _totals(counter: Counter, label: str) -> dict[str, float]:
    """A labelled prometheus counter's values summed by one of its labels."""
    out: dict[str, float] = {}
    for metric in counter.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                key = sample.labels[label]
                out[key] = out.get(key, 0) + sample.value
    return out


class _Devices:
    """The host's GPUs, discovered at most every DEVICES_TTL_S (NVML or a subprocess; off the event loop)."""

    def __init__(self) -> None:
        self._found: list[Device] = []
        self._error: str | None = None
        self._at = -math.inf

    def read(self) -> tuple[list[Device], str | None]:
        if time.monotonic() - self._at > DEVICES_TTL_S:
            try:
                self._found, self._error = discover(), None
            except ConfigError as exc:  # a bad $MPSERVE_SIMULATE_GPUS
                self._found, self._error = [], exc.message
            self._at = time.monotonic()
        return self._found, self._error


def gpu_views(devices: list[Device], rows: list[SlotRow], now: float) -> list[dict[str, Any]]:
    """Each GPU: memory where known, its permits (None: none in use), the slots on it and holding it."""
    out = []
    for d in devices:
        permits = inspect(d.key)
        on_device = [r for r in rows if r.state is not SlotState.EMPTY and r.device == d.index]
        view: dict[str, Any] = {
            "index": d.index, "name": d.name, "simulated": d.simulated, "memory_total": d.memory_total,
            "memory_free": d.memory_free, "slots": [r.index for r in on_device], "permits": None}
        if permits is not None:
            view["permits"] = {
                "capacity": permits.capacity,
                "held": [{"pid": h.pid, "held_s": round(now - h.since, 1),
                          "slots": [r.index for r in rows if h.pid and r.pid == h.pid]} for h in permits.holders],
                "waiting": [{"pid": w.pid, "waiting_s": round(now - w.since, 1),
                             "slots": [r.index for r in rows if r.pid == w.pid]} for w in permits.waiters]}
        out.append(view)
    return out


class Console:
    def __init__(self, backend: Backend, metrics: GatewayMetrics) -> None:
        self.backend = backend
        self.activity = Activity(metrics, time.time())
        self._devices = _Devices()

    def routes(self) -> list[Route]:
        return [Route("/", self.page, methods=["GET"]), Route("/console", self.page, methods=["GET"]),
                Route("/static/{name}", self.static, methods=["GET"]), Route(ICON, self.icon, methods=["GET"]),
                Route("/console/state", self.state, methods=["GET"])]

    def observe(self, local: LocalSlots | None) -> None:
        """One sample (the gateway's sampler calls it)."""
        self.activity.observe(local.rows if local is not None else None, time.time())

    async def page(self, request: Request) -> Response:
        return _file("console.html", "text/html")

    async def icon(self, request: Request) -> Response:
        return _file("favicon.svg", FILES["favicon.svg"])

    async def static(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in FILES:
            raise HTTPException(404)
        return _file(name, FILES[name])

    async def state(self, request: Request) -> Response:
        viewer = viewer_of(request)
        stats = await self.backend.stats()
        local = self.backend.read_slots()
        now = time.time()
        gpus: list[dict[str, Any]] = []
        gpu_error = None
        if local is not None:
            devices, gpu_error = await asyncio.to_thread(self._devices.read)
            gpus = await asyncio.to_thread(gpu_views, devices, local.rows, now)
        window_s, outcomes = self.activity.outcomes(now)
        return JSONResponse({
            "time": now,
            "server": {"name": self.backend.server_name, "address": self.backend.address,
                       "reachable": stats is not None, "accepting": stats.accepting if stats else False,
                       "local": local is not None, "started": local.server.started if local else None},
            "slots": [self._slot(r, now, viewer) for r in local.rows if r.state is not SlotState.EMPTY]
            if local else [],
            "pools": [_pool(w) for w in stats.workers if w.host or local is None] if stats else [],
            "models": [self._model(name, m, now) for name, m in stats.models.items()] if stats else [],
            "store": store_view(local.rows) if local else None,
            "outcomes": {"window_s": window_s, "codes": outcomes},
            "series_step_s": SERIES_STEP_S,
            "gpus": gpus, "gpu_error": gpu_error,
            "downloads": await asyncio.to_thread(downloads),
        })

    def _slot(self, row: SlotRow, now: float, viewer: Viewer) -> dict[str, Any]:
        state, shown = state_of(row), viewer.request(row)
        state_s, rate = self.activity.slot(row, now)
        mine = viewer.sees_all or shown is not None
        return {"index": row.index, "worker": row.worker, "slot": row.slot, "pid": row.pid, "state": state,
                "model": row.model, "device": "cpu" if row.device < 0 else f"gpu{row.device}",
                "request": shown if state in ("busy", "waiting") else None, "tokens": row.tokens if mine else None,
                "tokens_per_s": rate if mine else None, "state_s": state_s, "served": row.served,
                "load_s": round(row.load_s, 2), "adapters": row.adapters if mine else None}

    def _model(self, name: str, m: wire.ModelStats, now: float) -> dict[str, Any]:
        return {"name": name, "queued": m.queued, "oldest_wait_s": m.oldest_wait_s, "running": m.running,
                "instances": m.instances, "free_slots": m.free_slots, "failed": m.failed, "adapters": m.adapters,
                "tokens_per_s": self.activity.series(name, now)}


def store_view(rows: list[SlotRow]) -> dict[str, Any] | None:
    """The host store: its tiers, which are the host's (every model's and every server's on this host; the
    largest figure an instance last wrote), once; and per model, its instances' counts added up. None when no
    instance has one."""
    host = dict.fromkeys(("bytes", "capacity", "disk_bytes", "disk_capacity"), 0)
    models: dict[str, dict[str, int]] = {}
    for (model, _), slots in instance_slots(rows).items():
        c = slots[0].cache
        if not c.capacity:
            continue
        for key in host:
            host[key] = max(host[key], getattr(c, key))
        counts = models.setdefault(model, dict.fromkeys(("hits", "misses", "evictions", "skipped"), 0))
        for key in counts:
            counts[key] += getattr(c, key)
    return {"host": host, "models": models} if models else None


def _pool(w: wire.WorkerStats) -> dict[str, Any]:
    """A worker the broker knows, for a pool on another host (or any worker of a server not on this one)."""
    return {"worker": w.worker, "host": w.host, "model": w.model, "pid": w.pid,
            "device": "cpu" if w.device < 0 else f"gpu{w.device}", "capacity": w.capacity, "running": w.running}


def _file(name: str, media_type: str) -> Response:
    # no-cache: a browser asks again (and gets 304 when unchanged), so an upgraded server serves its new page
    return FileResponse(STATIC_DIR / name, media_type=media_type, headers={"Cache-Control": "no-cache"})
