"""``GET /metrics``: Prometheus text, rendered by prometheus_client from one registry per gateway.

Two kinds of metric:

- measured in the gateway, for the requests that pass through it: requests by endpoint and outcome code
  (``ok`` or the stable error code), those waiting now for a server to come back
  (``mpserve_http_requests_waiting_for_server``), prompt and generated tokens (by model, and by LoRA adapter: a request
  under two counts for each), speculative decoding's proposed and accepted draft tokens (from the DONE timings)
  and their ratio, time to first token (queueing plus prompt processing, from the DONE timings) and latency
  (HTTP request in to DONE out, measured here);
- read from the server at scrape time: queue depth, requests in flight and registered instances per model
  (STATS), the broker's counters since the server started (``mpserve_broker_events_total{event=...}``:
  ``accepted``, ``done``, ``timeout``, ``cancelled``, ``worker_lost``, ``rejected_busy``, the routes by why
  (``routed_kv_prefix``, ``routed_ram_prefix``, ``routed_least_busy``), ... whatever the
  broker counts), each model's instance bounds and scale events (``mpserve_scale_starts_total{reason=...}``,
  ``..._stops_total``, ``..._skipped_total``), per tenant (``mpserve_tenant_…{tenant=...}``: requests, prompt and
  generated tokens, queue seconds, limit refusals, preemptions, running and queued now; the broker names its
  busiest tenants, API keys by digest, and sums the rest as ``other``, so the label values are bounded: every
  tenant's series for the admin key or a gateway without API keys, the caller's own alone for a tenant's key), and, for
  a server on this host, instances (worker processes)
  and slots by state (slot table), the KV cells each instance holds and their share of all it has, its prompt
  cache (bytes, hits, misses, evictions), worker restarts and, when NVML answers, each GPU's memory and each
  instance's share of it;
- the model-server protocol's, which the Kubernetes inference gateway's endpoint picker reads
  (``picker_metrics``): requests waiting and running, KV-cache usage, LoRA adapters, the cache's block size.

A scrape fetches STATS first, then renders without awaiting anything, so one scrape sees one snapshot.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mpserve.client import Result
from mpserve.gpu.memory import GpuUsage, memory_by_pid
from mpserve.wire import protocol as wire
from mpserve.wire.slots import SlotRow, SlotState, instance_slots

from .monitor import ADMIN, Viewer, instance_state, state_of
from .picker_metrics import picker_metrics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(frozen=True)
class ServerView:
    """What a scrape read from the server: STATS (None: unreachable), the slot table (None: not local), the
    restarts counted so far per model, NVML's view of the GPUs (None: no GPU instance, or no NVML), and who
    asked (whose per-tenant series it may see)."""

    stats: wire.Stats | None
    rows: list[SlotRow] | None
    restarts: Mapping[str, int]
    gpus: Sequence[GpuUsage] | None = None
    viewer: Viewer = ADMIN


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("mpserve_http_requests", "Generation requests through the gateway, by endpoint "
                                "and outcome code (ok, or the error code)", ["endpoint", "code"],
                                registry=self.registry)
        self.prompt_tokens = Counter("mpserve_prompt_tokens", "Prompt tokens of completed requests", ["model"],
                                     registry=self.registry)
        self.generated_tokens = Counter("mpserve_generated_tokens", "Tokens generated for completed requests",
                                        ["model"], registry=self.registry)
        self.ttft = Histogram("mpserve_time_to_first_token_seconds", "Queueing plus prompt processing of "
                              "completed requests (from their DONE timings)", ["model"], buckets=TTFT_BUCKETS,
                              registry=self.registry)
        self.draft_tokens = Counter("mpserve_draft_tokens", "Speculative decoding: tokens proposed and verified "
                                    "for completed requests", ["model"], registry=self.registry)
        self.accepted_tokens = Counter("mpserve_draft_accepted_tokens", "Speculative decoding: proposed tokens "
                                       "the completed requests kept", ["model"], registry=self.registry)
        self.acceptance = Gauge("mpserve_draft_acceptance_ratio", "Speculative decoding: accepted over proposed "
                                "draft tokens, all completed requests so far", ["model"], registry=self.registry)
        self._drafts: dict[str, tuple[int, int]] = {}  # model -> proposed, accepted
        self.adapter_requests = Counter("mpserve_adapter_requests", "Completed requests that ran under a LoRA "
                                        "adapter, by model and adapter", ["model", "adapter"], registry=self.registry)
        self.adapter_tokens = Counter("mpserve_adapter_tokens", "Prompt and generated tokens of the completed "
                                      "requests that ran under a LoRA adapter", ["model", "adapter", "kind"],
                                      registry=self.registry)
        self.latency = Histogram("mpserve_request_latency_seconds", "HTTP request received to DONE, measured in "
                                 "the gateway", ["model"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.waiting_for_server = Gauge("mpserve_http_requests_waiting_for_server", "Requests received while no "
                                        "server answers, waiting for one to come back (up to the reattach bound)",
                                        registry=self.registry)
        self._server = _ServerCollector()
        self.registry.register(self._server)

    def outcome(self, endpoint: str, code: str) -> None:
        self.requests.labels(endpoint, code).inc()

    def done(self, model: str, result: Result, elapsed_s: float, adapters: Sequence[str] = ()) -> None:
        """A completed request of ``model``, run under the LoRA ``adapters`` (names)."""
        self.prompt_tokens.labels(model).inc(result.usage.prompt_tokens)
        self.generated_tokens.labels(model).inc(result.usage.completion_tokens)
        for adapter in adapters:
            self.adapter_requests.labels(model, adapter).inc()
            self.adapter_tokens.labels(model, adapter, "prompt").inc(result.usage.prompt_tokens)
            self.adapter_tokens.labels(model, adapter, "generated").inc(result.usage.completion_tokens)
        t = result.timings
        self.ttft.labels(model).observe((t.queue_ms + t.prompt_ms) / 1000)
        if t.draft_tokens:
            self.draft_tokens.labels(model).inc(t.draft_tokens)
            self.accepted_tokens.labels(model).inc(t.accepted_tokens)
            proposed, accepted = self._drafts.get(model, (0, 0))
            proposed, accepted = proposed + t.draft_tokens, accepted + t.accepted_tokens
            self._drafts[model] = proposed, accepted
            self.acceptance.labels(model).set(accepted / proposed)
        self.latency.labels(model).observe(elapsed_s)

    def render(self, view: ServerView) -> bytes:
        self._server.view = view
        return generate_latest(self.registry)


class _ServerCollector(Collector):
    """Metrics read from the server, from the view the current scrape fetched."""

    def __init__(self) -> None:
        self.view = ServerView(None, None, {})

    def describe(self) -> list[Metric]:
        return []  # families depend on the server; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        stats, rows = self.view.stats, self.view.rows
        up = GaugeMetricFamily("mpserve_up", "1 when the server answered STATS")
        up.add_metric([], 1.0 if stats is not None else 0.0)
        yield up
        if stats is None:
            return
        accepting = GaugeMetricFamily("mpserve_accepting", "1 while the server takes new requests (0: stopping)")
        accepting.add_metric([], 1.0 if stats.accepting else 0.0)
        yield accepting
        queued = GaugeMetricFamily("mpserve_queue_depth", "Requests waiting for an instance", labels=["model"])
        running = GaugeMetricFamily("mpserve_requests_in_flight", "Requests running on an instance",
                                    labels=["model"])
        registered = GaugeMetricFamily("mpserve_registered_instances", "Instances registered with the broker",
                                       labels=["model"])
        failed = GaugeMetricFamily("mpserve_model_failed", "1 when the model failed to load and is not retried",
                                   labels=["model"])
        for name, m in stats.models.items():
            queued.add_metric([name], m.queued)
            running.add_metric([name], m.running)
            registered.add_metric([name], m.instances)
            failed.add_metric([name], 1.0 if m.failed else 0.0)
        yield from (queued, running, registered, failed)
        yield from picker_metrics(stats, rows)
        events = CounterMetricFamily("mpserve_broker_events", "The broker's counters since the server started",
                                     labels=["event"])
        for event, value in sorted(stats.counters.items()):
            events.add_metric([event], value)
        yield events
        yield from _scaling_metrics(stats)
        yield from _tenant_metrics(stats, self.view.viewer)
        if rows is None:
            return
        yield from _state_metrics(stats, rows)
        yield from _kv_metrics(rows)
        restarts = CounterMetricFamily("mpserve_worker_restarts", "Worker processes replaced, as observed by the "
                                       "gateway since it first saw this server", labels=["model"])
        for name in stats.models:
            restarts.add_metric([name], self.view.restarts.get(name, 0))
        yield restarts
        if self.view.gpus:
            yield from _gpu_metrics(self.view.gpus, rows)


def _state_metrics(stats: wire.Stats, rows: list[SlotRow]) -> Iterator[Metric]:
    """Instances (worker processes) by state, and slots by state, per model (slot table)."""
    instances = GaugeMetricFamily("mpserve_instances", "Instances (worker processes) by state: busy while any of "
                                  "its slots serves (slot table)", labels=["model", "state"])
    slots = GaugeMetricFamily("mpserve_slots", "Slots by state (slot table)", labels=["model", "state"])
    by_instance = instance_slots(rows)
    for name in stats.models:
        zero = {s.name.lower(): 0 for s in SlotState if s is not SlotState.EMPTY} | {"exited": 0}
        groups = [group for (model, _), group in by_instance.items() if model == name]
        of_instances = zero | collections.Counter(instance_state(group) for group in groups)
        of_slots = zero | collections.Counter(state_of(r) for group in groups for r in group)
        for family, counts in ((instances, of_instances), (slots, of_slots)):
            for state, count in counts.items():
                family.add_metric([name, state], count)
    yield from (instances, slots)


def _kv_metrics(rows: list[SlotRow]) -> Iterator[Metric]:
    """Per instance (slot table): the KV cells its slots hold and their share of all it has; the host store as it
    sees it, under its names and, for one release, its former ones (``STORE_BEFORE``)."""
    labels = ["model", "worker"]
    cells = GaugeMetricFamily("mpserve_kv_cells_used", "KV cells an instance's slots hold (slot table)",
                              labels=labels)
    ratio = GaugeMetricFamily("mpserve_kv_usage_ratio", "KV cells an instance's slots hold, of all it has "
                              "(parallel x n_ctx)", labels=labels)
    cache = _store_families(GaugeMetricFamily, labels, (
        ("bytes", "Bytes the host store's RAM tier holds (all instances on the host), as an instance last saw it"),
        ("capacity_bytes", "Bytes the host store's RAM tier may hold (cache_ram)"),
        ("disk_bytes", "Bytes the host store's disk tier holds, as an instance last saw it"),
        ("disk_capacity_bytes", "Bytes the host store's disk tier may hold (cache_disk_size; 0: no disk tier)")))
    counts = _store_families(CounterMetricFamily, labels, (
        ("hits", "An instance's prompts that restored a prefix from the host store"),
        ("misses", "An instance's prompts that looked in the host store and found nothing the slots did not hold"),
        ("evictions", "Host store entries an instance removed from the last tier to make room (least recently "
                      "used first)"),
        ("skipped", "Host store entries an instance skipped and removed as bad (truncated, foreign, corrupt), and "
                    "writes it could not make (a full disk)")))
    remote = {name: CounterMetricFamily(f"{STORE}remote_{name}", text, labels=labels) for name, text in (
        ("hits", "An instance's prompts that restored a prefix from the host store's remote tier (cache_remote)"),
        ("misses", "An instance's lookups in the remote tier that found nothing it could use (none, a bad entry, "
                   "or the tier down)"),
        ("errors", "An instance's calls to the remote tier that failed (Redis down, slow or refusing)"),
        ("dropped", "Entries an instance did not write to the remote tier (its queue full, or the tier down)"))}
    for (model, worker), slots in instance_slots(rows).items():
        used, capacity = sum(r.kv_cells for r in slots), sum(r.kv_capacity for r in slots)
        key = [model, str(worker)]
        for name, counter in remote.items():
            counter.add_metric(key, getattr(slots[0].cache, f"remote_{name}"))
        cells.add_metric(key, used)
        ratio.add_metric(key, used / capacity if capacity else 0.0)
        c = slots[0].cache
        values = {"bytes": c.bytes, "capacity_bytes": c.capacity, "disk_bytes": c.disk_bytes,
                  "disk_capacity_bytes": c.disk_capacity} | {name: getattr(c, name) for name, _ in counts}
        for (name, _), family in (cache | counts).items():
            family.add_metric(key, values[name])
    yield from (cells, ratio, *cache.values(), *counts.values(), *remote.values())


STORE = "mpserve_host_store_"
STORE_BEFORE = "mpserve_prompt_cache_"  # the same figures' former names, kept for one release (docs/operations.md)
_Family = TypeVar("_Family", GaugeMetricFamily, CounterMetricFamily)


def _store_families(family: type[_Family], labels: list[str],
                    texts: tuple[tuple[str, str], ...]) -> dict[tuple[str, str], _Family]:
    """A family per host-store figure under each name: ``(figure, prefix) -> family``."""
    return {(name, prefix): family(prefix + name, text if prefix == STORE else f"{text} (former name of "
                                   f"{STORE}{name}, removed in the next release)", labels=labels)
            for prefix in (STORE, STORE_BEFORE) for name, text in texts}


def _scaling_metrics(stats: wire.Stats) -> Iterator[Metric]:
    """Instance bounds and counts per model, and scale events by reason (``start_queue`` -> starts{queue})."""
    gauges = {key: GaugeMetricFamily(f"mpserve_instances_{key}", text, labels=["model"]) for key, text in (
        ("min", "Fewest instances the model scales to"), ("max", "Most instances the model scales to"),
        ("starting", "Instances started and not registered yet"),
        ("draining", "Instances finishing their requests before they stop (scaled down)"))}
    counters = {kind: CounterMetricFamily(f"mpserve_scale_{name}", text, labels=["model", "reason"])
                for kind, name, text in (("start", "starts", "Instances started by the scaler, by reason"),
                                         ("stop", "stops", "Instances drained and stopped, by reason"),
                                         ("skip", "skipped", "Scale-ups that were due but skipped, by reason"))}
    for name, m in stats.models.items():
        sc = m.scaling
        for key, family in gauges.items():
            family.add_metric([name], getattr(sc, key))
        for event, count in sorted(sc.events.items()):
            kind, _, reason = event.partition("_")
            if kind in counters:
                counters[kind].add_metric([name, reason], count)
    yield from gauges.values()
    yield from counters.values()


_TENANT_FIGURES = (
    ("requests", CounterMetricFamily, "Requests the broker accepted from the tenant"),
    ("prompt_tokens", CounterMetricFamily, "Prompt tokens of the tenant's requests that ended"),
    ("generated_tokens", CounterMetricFamily, "Tokens generated for the tenant's requests that ended"),
    ("queue_seconds", CounterMetricFamily, "Seconds the tenant's requests waited in the queue before they started"),
    ("refusals", CounterMetricFamily, "The tenant's requests refused over one of its limits (max_queued, "
                                      "tokens_per_minute)"),
    ("preemptions", CounterMetricFamily, "The tenant's running requests preempted for ones of higher priority"),
    ("running", GaugeMetricFamily, "The tenant's requests running now"),
    ("queued", GaugeMetricFamily, "The tenant's requests waiting now"),
)


def _tenant_metrics(stats: wire.Stats, viewer: Viewer) -> Iterator[Metric]:
    """Per tenant, as the broker names them (its busiest, then ``other``): every one for the admin, the viewer's
    own alone for a tenant (none while the broker sums it into ``other``)."""
    shown = [(tenant, figures) for tenant, figures in sorted(stats.tenants.items())
             if viewer.sees_all or tenant == viewer.tenant]
    for name, family, text in _TENANT_FIGURES:
        metric = family(f"mpserve_tenant_{name}", text, labels=["tenant"])
        field = "queue_s" if name == "queue_seconds" else name
        for tenant, figures in shown:
            metric.add_metric([tenant], getattr(figures, field))
        yield metric


def _gpu_metrics(gpus: Sequence[GpuUsage], rows: list[SlotRow]) -> Iterator[Metric]:
    labels = ["gpu", "uuid"]
    total = GaugeMetricFamily("mpserve_gpu_memory_total_bytes", "GPU memory (NVML)", labels=labels)
    used = GaugeMetricFamily("mpserve_gpu_memory_used_bytes", "GPU memory in use, by any process (NVML)",
                             labels=labels)
    free = GaugeMetricFamily("mpserve_gpu_memory_free_bytes", "GPU memory free (NVML)", labels=labels)
    for g in gpus:
        for family, value in ((total, g.total), (used, g.used), (free, g.free)):
            family.add_metric([str(g.index), g.uuid], value)
    yield from (total, used, free)
    held = memory_by_pid(gpus)
    instance = GaugeMetricFamily("mpserve_instance_gpu_memory_bytes", "GPU memory held by an instance's process "
                                 "(NVML; absent where NVML does not tell)", labels=["model", "worker", "gpu"])
    seen: set[int] = set()
    for row in rows:
        if row.device >= 0 and row.pid in held and row.pid not in seen and row.state is not SlotState.EMPTY:
            seen.add(row.pid)  # the slots of one instance share its process
            instance.add_metric([row.model, str(row.worker), str(row.device)], held[row.pid])
    yield instance
