"""The model-server protocol's metrics: what the Kubernetes inference gateway's endpoint picker reads from each
server to choose where a request goes (gateway-api-inference-extension, ``docs/proposals/003-model-server-protocol``).

    STATS (broker) ──queued, running per model──▶ mpserve_num_requests_waiting / _running  (sums over the models)
    slot table ──kv_cells of running slots──────▶ mpserve_kv_cache_usage_ratio            (of all cells: 0 .. 1)
               ──adapters of BUSY / WAITING────▶ mpserve_lora_requests_info{running_lora_adapters, waiting_...}
    STATS adapters per model, queued ones ──────▶   ... waiting_lora_adapters (with the WAITING rows'), max_lora
    KV events' block size, cells ───────────────▶ mpserve_cache_config_info{block_size, num_gpu_blocks}

One series each, with no model label: the picker reads one series of a family per pod (the first that matches its
flag, or for the LoRA family the one with the greatest value), and a pod is a whole server. The names are mpserve's
own, not vLLM's (the protocol asks for the types and meanings, not the names): a dashboard built for vLLM would read
vLLM's other families under the same prefix and find them missing. The picker is pointed at these names by its
flags (``deploy/kubernetes/inference-pool.yaml``).

Meanings, as the protocol gives them:

- waiting: requests in the broker's queues, not yet on a slot;
- running: requests on a slot (decoding, computing their prompt, or holding their slot while they wait for the
  GPU's permit);
- KV-cache usage: the cells the running sequences hold, over all the cells the instances have. An idle slot's cells
  are a cache that the next prompt may reuse or take, so they count as free, as vLLM counts the cached blocks of
  finished requests;
- LoRA: the adapters of the sequences on a slot (``running_lora_adapters``), of the requests in the broker's queues
  and of those on a slot that wait for the GPU's permit (``waiting_lora_adapters``; STATS names each model's queued
  ones), and the most adapters a batch may use (``max_lora``): an instance holds all of its model's adapters loaded,
  so the most adapters any served model has. The value is the scrape's time, as vLLM's.

Without a slot table (a gateway in front of a server on another host) only the two request counts are given.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from mpserve.wire import protocol as wire
from mpserve.wire.kv_events import BLOCK_SIZE
from mpserve.wire.slots import SlotRow, SlotState

WAITING = "mpserve_num_requests_waiting"
RUNNING = "mpserve_num_requests_running"
KV_USAGE = "mpserve_kv_cache_usage_ratio"
LORA_INFO = "mpserve_lora_requests_info"
CACHE_INFO = "mpserve_cache_config_info"
_ON_SLOT = (SlotState.BUSY, SlotState.WAITING)


def picker_metrics(stats: wire.Stats, rows: list[SlotRow] | None) -> Iterator[Metric]:
    waiting = GaugeMetricFamily(WAITING, "Requests waiting in the queues for a slot (all models)")
    waiting.add_metric([], sum(m.queued for m in stats.models.values()))
    running = GaugeMetricFamily(RUNNING, "Requests on a slot (all models)")
    running.add_metric([], sum(m.running for m in stats.models.values()))
    yield from (waiting, running)
    if rows is None:
        return
    live = [r for r in rows if r.state not in (SlotState.EMPTY, SlotState.DEAD, SlotState.FAILED)]
    held = sum(r.kv_cells for r in live if r.state in _ON_SLOT)
    capacity = sum(r.kv_capacity for r in live)
    usage = GaugeMetricFamily(KV_USAGE, "KV cells the running sequences hold, of all the instances' cells (0 to 1)")
    usage.add_metric([], held / capacity if capacity else 0.0)
    yield usage
    yield _lora_info(stats, live)
    config = GaugeMetricFamily(CACHE_INFO, "The KV cache's layout: tokens per block (as the KV events count "
                               "them) and the blocks all instances' cells make",
                               labels=["block_size", "num_gpu_blocks"])
    config.add_metric([str(BLOCK_SIZE), str(capacity // BLOCK_SIZE)], 1.0)
    yield config


def _lora_info(stats: wire.Stats, live: list[SlotRow]) -> Metric:
    running = _adapter_names(r for r in live if r.state is SlotState.BUSY)
    queued = {name for m in stats.models.values() for name in m.queued_adapters}
    waiting = sorted(queued.union(_adapter_names(r for r in live if r.state is SlotState.WAITING)))
    most = max((len(m.adapters) for m in stats.models.values()), default=0)
    info = GaugeMetricFamily(LORA_INFO, "LoRA adapters of the running and waiting sequences, and the most a batch "
                             "may use; the value is when it was read (unix time)",
                             labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
    info.add_metric([",".join(running), ",".join(waiting), str(most)], time.time())
    return info


def _adapter_names(rows: Iterator[SlotRow]) -> list[str]:
    """The adapter names in the rows' adapter labels ("a+b*0.5": a and b), sorted, each once; a label cut short
    (ending in "~") loses its last name, which would be a wrong one."""
    names: set[str] = set()
    for row in rows:
        parts = row.adapters.split("+") if row.adapters else []
        if parts and parts[-1].endswith("~"):
            parts.pop()
        names.update(part.split("*")[0] for part in parts)
    return sorted(names)
