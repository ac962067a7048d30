"""What the commands print: ``mpserve status`` and ``models`` (the slot table, each instance's cells and host store,
the scaling, remote pools and tenants under it), ``generate``'s summary, ``slots``' and ``devices``' lines; and the
error that names the servers running here when the one asked for is not.

    SlotRow[] ──format_table──▶ the table, then a line per instance (_instance_lines)
    Stats ──extra_lines──▶ a model's settings and scaling, a remote pool's instance, a tenant's figures
    SlotRow[], Stats ──status_json──▶ what `status --json` prints
    Result ──format_result──▶ generate's line on stderr: finish, tokens, times, worker
    SlotReply ──format_slot_reply──▶ a slot saved, restored or erased
    devices' rows ──format_devices──▶ a GPU a line, its permits, its memory and processes under NVML
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import msgspec

from mpserve.counts import counted
from mpserve.errors import ConnectionFailed
from mpserve.runtime import ServerInfo, pid_alive, runtime_dir
from mpserve.wire.messages import ModelControl, SlotReply, Stats
from mpserve.wire.slots import BASE_LABEL, SlotRow, SlotState, active_sets, instance_slots


def no_server(name: str) -> ConnectionFailed:
    """No server ``name`` runs here: the error names those that do."""
    running = sorted(info.name for path in runtime_dir(create=False).glob("*.json")
                     if (info := ServerInfo.read(path.stem)) is not None and info.alive())
    others = f"running here: {', '.join(running)} (--server-name NAME)" if running else "none runs here"
    return ConnectionFailed(f"no server named {name!r} is running ({others}); start one with `mpserve start`")



def format_models(rows: list[ModelControl]) -> str:
    lines = [["MODEL", "STATE", "INSTANCES", "STARTING", "DRAINING", "MIN", "MAX", "CEILING", "PATH"]]
    lines += [[m.name, m.state, str(m.instances), str(m.starting), str(m.draining), str(m.min), str(m.max),
               str(m.ceiling), m.path] for m in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines)


def format_table(info: ServerInfo, rows: list[SlotRow]) -> str:
    now = time.time()
    head = ["SLOT", "WORKER", "PID", "STATE", "MODEL", "DEVICE", "REQUEST", "ADAPTERS", "TOKENS", "KV CELLS",
            "IDLE/BUSY FOR", "LOAD", "SERVED"]
    lines = [head]
    for r in rows:
        if r.state is SlotState.EMPTY:  # a slot of an instance not started (it may start as the load grows)
            continue
        alive = r.pid > 0 and pid_alive(r.pid)
        state = r.state.name.lower() if alive or r.state in (SlotState.DEAD, SlotState.FAILED) else "dead"
        lines.append([str(r.index), str(r.worker), str(r.pid or "-"), state, r.model,
                      "cpu" if r.device < 0 else f"gpu{r.device}", r.request or "-", r.adapters or "-", str(r.tokens),
                      f"{r.kv_cells}/{r.kv_capacity}", f"{now - r.progress:.1f}s" if r.progress else "-",
                      f"{r.load_s:.2f}s", str(r.served)])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    body = "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines)
    started = instance_slots(rows)
    counts = f"{counted(len(started), 'instance')} (processes), {counted(sum(map(len, started.values())), 'slot')}"
    return f"server {info.name!r} pid {info.pid} at {info.front}: {counts}\n{body}{_instance_lines(rows)}"


def _instance_lines(rows: list[SlotRow]) -> str:
    """Per instance: the KV cells its slots hold, of all it has, and its counts in the host store; then the host
    store's tiers once, as they are the host's (every model's and server's on it), not an instance's."""
    from mpserve.gpu.devices import format_memory

    lines, tiers = [], []
    for (model, worker), slots in instance_slots(rows).items():
        used, capacity = sum(r.kv_cells for r in slots), sum(r.kv_capacity for r in slots)
        share = f" ({100 * used / capacity:.0f}%)" if capacity else ""
        c = slots[0].cache
        cache = (f"host store: {c.hits} hits, {c.misses} misses, {c.evictions} evictions, {c.skipped} skipped"
                 if c.capacity else "no host store")
        if c.remote_hits or c.remote_misses or c.remote_errors or c.remote_dropped:
            cache += (f"; remote tier: {c.remote_hits} hits, {c.remote_misses} misses, {c.remote_errors} errors, "
                      f"{c.remote_dropped} writes dropped")
        sets = active_sets(slots)
        active = f"; adapter sets running: {', '.join(sets)}" if any(s != BASE_LABEL for s in sets) else ""
        lines.append(f"instance w{worker} ({model}): KV cells {used} of {capacity}{share}; {cache}{active}")
        tiers += [c] if c.capacity else []
    if tiers:  # each instance wrote the host's figures when it last touched the store: the largest is the latest
        ram, disk = max(tiers, key=lambda c: c.bytes), max(tiers, key=lambda c: c.disk_bytes)
        on_disk = (f", disk {format_memory(disk.disk_bytes)} of {format_memory(disk.disk_capacity)}"
                   if disk.disk_capacity else "")
        lines.append(f"host store (host-wide, every model and server on this host): RAM {format_memory(ram.bytes)} "
                     f"of {format_memory(ram.capacity)}{on_disk}")
    return "\n\n" + "\n".join(lines) if lines else ""


if TYPE_CHECKING:
    from mpserve.client import Result
    from mpserve.gpu.memory import GpuUsage


def extra_lines(stats: Stats | None) -> Iterator[str]:
    """The lines under the table, from the broker's STATS (None: none asked, or no answer): each model's settings
    and scaling, each remote pool's instance, each tenant's figures (the busiest first)."""
    if stats is None:
        return
    for name, sc in ((name, m.scaling) for name, m in stats.models.items()):
        if sc.settings:
            rolling = (f"; rolling: {counted(sc.previous, 'instance')} still on the settings before the reload"
                       if sc.previous else "")
            yield f"model {name}: {sc.settings}{rolling}"
        if sc.min != sc.ceiling or sc.events:  # a model whose count may change
            events = ", ".join(f"{k} {v}" for k, v in sorted(sc.events.items())) or "none"
            yield (f"scaling {name}: {sc.min}..{sc.max} instances, {sc.starting} starting, {sc.draining} draining; "
                   f"events: {events}")
    for w in (w for w in stats.workers if w.host):
        yield (f"remote  {w.worker}  host {w.host}  pid {w.pid}  {w.model}  "
               f"{'cpu' if w.device < 0 else f'gpu{w.device}'}  running {w.running}/{w.capacity}")
    for name, t in sorted(stats.tenants.items(), key=lambda item: -item[1].requests):
        yield (f"tenant {name}: {t.running} running, {t.queued} queued; {counted(t.requests, 'request')}, "
               f"{t.prompt_tokens} prompt and {t.generated_tokens} generated tokens, {t.queue_s:.1f} s queued, "
               f"{t.refusals} refused over a limit, {t.preemptions} preempted")


def status_json(info: ServerInfo, rows: Sequence[SlotRow], stats: Stats | None) -> dict[str, Any]:
    """What `mpserve status --json` prints: the server, its slot rows, and from STATS its remote pools' instances,
    its models' scaling and its tenants' figures."""
    slots = [{**asdict(r), "state": r.state.name.lower()} for r in rows]
    if stats is None:
        return {"server": info.name, "pid": info.pid, "address": info.front, "slots": slots, "remote": [],
                "scaling": {}, "tenants": {}}
    return {"server": info.name, "pid": info.pid, "address": info.front, "slots": slots,
            "remote": [msgspec.structs.asdict(w) for w in stats.workers if w.host],
            "scaling": {name: vars(m.scaling) for name, m in stats.models.items()},
            "tenants": {name: asdict(t) for name, t in stats.tenants.items()}}


def format_result(result: Result) -> str:
    """`mpserve generate`'s summary of a completion: why it ended, its tokens, its times and its worker."""
    t = result.timings
    tps = result.usage.completion_tokens / (t.generate_ms / 1000) if t.generate_ms else 0.0
    return (f"[{result.finish_reason}; {result.usage.prompt_tokens} prompt + {result.usage.completion_tokens} "
            f"generated tokens; queued {t.queue_ms:.0f} ms, first token {t.prompt_ms:.0f} ms, {tps:.1f} tokens/s; "
            f"{result.worker}]")


def format_slot_reply(reply: SlotReply, slot: int, worker: str, local: int, filename: str) -> str:
    """`mpserve slots`' line: what was done to the slot, its tokens, the file's size and name, the time."""
    from mpserve.gpu.devices import format_memory

    done = {"save": "saved", "restore": "restored", "erase": "erased"}[reply.action]
    where = f" ({format_memory(reply.bytes)}, {filename})" if reply.action != "erase" else ""
    return f"{done} slot {slot} ({worker} slot {local}): {reply.tokens} tokens{where} in {reply.ms:.0f} ms"


def format_devices(rows: Sequence[Mapping[str, Any]], live: Mapping[str, GpuUsage]) -> str:
    """`mpserve devices`' lines: a GPU each, its free memory and permits, and under NVML (``live``, by uuid) the
    memory used and the processes holding it."""
    from mpserve.gpu.devices import format_memory

    if not rows:
        return "no GPU found (no NVML, no nvidia-smi): instances run on the CPU"
    lines = []
    for r in rows:
        permits = ("no permits in use" if r["permit_capacity"] is None else
                   f"permits {len(r['holders'])}/{r['permit_capacity']} held by {r['holders'] or '-'}, "
                   f"waiting: {r['waiters'] or '-'}")
        lines.append(f"gpu{r['index']}  {r['name']}{' (simulated)' if r['simulated'] else ''}  "
                     f"{format_memory(int(r['memory_free']))} free of {format_memory(int(r['memory_total']))}  "
                     f"{permits}")
        if (usage := live.get(str(r["uuid"]))) is not None:
            held = ", ".join(f"{p.pid} {'?' if p.used is None else format_memory(p.used)}" for p in usage.processes)
            lines.append(f"      {format_memory(usage.used)} used; processes: {held or '-'}")
    return "\n".join(lines)
