"""The figures STATS carries per model and per tenant (``mpserve.wire.messages.Stats``): dataclasses, not Structs,
so that msgspec leaves a newer server's extra fields out and the gateway answers them as JSON with
``dataclasses.asdict``.

    broker (server/clients: snapshot) ──ModelStats, ModelScaling, TenantStats──▶ STATS ──▶ mpserve status, the
        gateway's /metrics and /v1/models, the console
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelScaling:
    """A model's instance bounds (``ceiling``: the most the server was sized for at start) and its scale
    events since start, by kind and reason (``start_queue``, ``stop_idle``, ``skip_does_not_fit``, ``stop_roll``,
    ...).
    Like ModelStats and ModelControl, a dataclass: msgspec leaves a newer server's extra fields out, and the
    gateway answers it as JSON with ``dataclasses.asdict``, as it does Timings."""

    min: int = 0
    max: int = 0
    ceiling: int = 0
    starting: int = 0
    draining: int = 0
    events: dict[str, int] = field(default_factory=dict)
    settings: str = ""  # the settings its instances start with (``mpserve.server.rolling.settings``)
    previous: int = 0  # instances still running on the settings before a reload (a roll in progress)


@dataclass
class TenantStats:
    """One tenant's figures since start (``mpserve.server.tenants``): requests accepted, tokens of those that ended,
    seconds its requests waited before they started, requests refused over its limits, its running requests
    preempted; and now: its requests running and queued. A dataclass, as ModelStats."""

    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    queue_s: float = 0.0
    refusals: int = 0
    preemptions: int = 0
    running: int = 0
    queued: int = 0


@dataclass(frozen=True)
class ModelStats:
    queued: int
    running: int
    instances: int  # registered and alive
    free_slots: int
    failed: str | None = None
    chat_template: str = ""  # the model's (Jinja2, from its GGUF), with the token texts it refers to
    bos_token: str = ""
    eos_token: str = ""
    oldest_wait_s: float = 0.0  # how long the request at the head of the queue has waited; 0 when none waits
    scaling: ModelScaling = field(default_factory=ModelScaling)
    adapters: list[str] = field(default_factory=list)  # its LoRA adapters, in the order of their ids
    preempted: int = 0  # its requests preempted since start, to give their slots to ones of higher priority
    adapter_ids: list[int] = field(default_factory=list)  # each adapter's id (llama-server's), never reused
    queued_adapters: list[str] = field(default_factory=list)  # the adapters its queued requests ask for, each once

    def served_adapters(self) -> dict[str, int]:
        """Each adapter's id by its name (a server that sends no ids counts them in its list, as before)."""
        ids = self.adapter_ids if len(self.adapter_ids) == len(self.adapters) else range(len(self.adapters))
        return dict(zip(self.adapters, ids, strict=True))
