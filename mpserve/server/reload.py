"""A reload: the configuration read again and what changed applied, with nothing restarted that need not be.

    SIGHUP, or CONTROL reload (``mpserve reload``) ──▶ the loop calls ``reread()``: the file and the flags the
        server started with, read again (a ConfigError refuses the whole reload: the running configuration stays)
        ──▶ diff(running, new) ──▶ Changes:
              at once     the server's queue bounds, pending requests per client, client and no-instance timeouts,
                          grace, log level and tenants (AT_ONCE: the broker's and the loop's own values)
              bounds      a model's instances (min, max) and its scale-up / scale-down delays: as ``scale``
              added       a model: as ``add``, with every setting of its entry
              removed     a model: new requests refused at once (``unknown_model``, naming the reload), queued and
                          running ones finish, its instances drain
              rolled      a model's settings that need a new context or other weights (n_ctx, parallel, KV types,
                          the draft model, its file, ...): its instances replaced one at a time
                          (``mpserve.server.rolling``)
              kept        anything else that differs (an address, a key folder, what a model serves: embeddings,
                          their pooling, its adapters): one line each saying it needs a restart; it keeps its
                          running value
        ──▶ ``Changes.lines()``: one line per change, logged and answered to ``mpserve reload``

``diff`` is a pure function of the two configurations; the loop applies what it returns (``ServerLoop.reload``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mpserve.config.loader import ModelConfig, ServerConfig
from mpserve.config.tenants import Tenants

AT_ONCE = ("max_queue", "max_queue_total", "max_pending_per_client", "client_timeout", "no_instance_timeout",
           "grace", "log_level", "tenants")
"""Server settings a reload applies at once."""
DERIVED = frozenset({"models", "threads_total"})  # compared model by model, or not a setting
MODEL_AT_ONCE = frozenset({"instances", "min_instances", "max_instances", "scale_up_after", "scale_down_after"})
MODEL_KEPT = frozenset({"name", "embedding", "pooling", "adapters"})
"""A model's settings a reload cannot change: what it serves (the API its requests take), and its LoRA adapters
(``mpserve adapters`` loads and unloads them at run time). Every other one rolls its instances."""


@dataclass(frozen=True)
class Changes:
    at_once: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # setting -> (running, new)
    bounds: dict[str, ModelConfig] = field(default_factory=dict)  # model -> its new entry (bounds, delays)
    added: tuple[ModelConfig, ...] = ()
    removed: tuple[str, ...] = ()
    rolled: dict[str, tuple[ModelConfig, tuple[str, ...]]] = field(default_factory=dict)  # model -> its new entry,
    # and what changed ("n_ctx 2048 -> 4096")
    kept: tuple[str, ...] = ()  # one line each: what differs and needs a restart

    def __bool__(self) -> bool:
        return bool(self.at_once or self.bounds or self.added or self.removed or self.rolled or self.kept)

    def lines(self) -> list[str]:
        out = [f"{key}: {_shown(old)} -> {_shown(new)}" for key, (old, new) in self.at_once.items()]
        out += [f"models[{name}]: instances {_bounds(m)}, scale_up_after {m.scale_up_after:g} s, scale_down_after "
                f"{m.scale_down_after:g} s" for name, m in self.bounds.items()]
        out += [f"models[{m.name}]: added ({m.path}, instances {_bounds(m)})" for m in self.added]
        out += [f"models[{name}]: removed (new requests refused; its requests finish, then its instances drain)"
                for name in self.removed]
        out += [f"models[{name}]: {', '.join(what)}: rolling (its instances replaced one at a time)"
                for name, (_, what) in self.rolled.items()]
        out += [f"{line}: needs a restart; the running value stays" for line in self.kept]
        return out or ["nothing changed"]


def diff(running: ServerConfig, new: ServerConfig) -> Changes:
    """What a reload from ``running`` to ``new`` changes, and what it must keep."""
    at_once, kept = {}, []
    for f in dataclasses.fields(ServerConfig):
        old, now = getattr(running, f.name), getattr(new, f.name)
        if f.name in DERIVED or old == now:
            continue
        if f.name in AT_ONCE:
            at_once[f.name] = (old, now)
        else:
            kept.append(f"{f.name} {old!r} -> {now!r}")
    before = {m.name: m for m in running.models}
    after = {m.name: m for m in new.models}
    bounds, rolled = {}, {}
    for name in sorted(before.keys() & after.keys()):
        changed = [f.name for f in dataclasses.fields(ModelConfig)
                   if getattr(before[name], f.name) != getattr(after[name], f.name)]
        if any(key in MODEL_AT_ONCE for key in changed):
            bounds[name] = after[name]
        rolls = [key for key in changed if key not in MODEL_AT_ONCE | MODEL_KEPT]
        if rolls:
            entry = dataclasses.replace(after[name], **{key: getattr(before[name], key) for key in MODEL_KEPT})
            rolled[name] = (entry, tuple(f"{key} {_shown(getattr(before[name], key))} -> "
                                         f"{_shown(getattr(after[name], key))}" for key in rolls))
        kept += [f"models[{name}].{key} {getattr(before[name], key)!r} -> {getattr(after[name], key)!r}"
                 for key in changed if key in MODEL_KEPT]
    return Changes(at_once, bounds, tuple(after[n] for n in after if n not in before),
                   tuple(n for n in before if n not in after), rolled, tuple(kept))


def settings_differ(running: ModelConfig, new: ModelConfig) -> list[str]:
    """A model's settings that differ and that a reload cannot change (not ``MODEL_AT_ONCE``), one line each."""
    return [f"models[{running.name}].{f.name} {getattr(running, f.name)!r} -> {getattr(new, f.name)!r}"
            for f in dataclasses.fields(ModelConfig)
            if f.name not in MODEL_AT_ONCE and getattr(running, f.name) != getattr(new, f.name)]


def applied(running: ServerConfig, changes: Changes) -> ServerConfig:
    """The configuration that runs after ``changes``: the new values of what applied, the running ones of what is
    kept, the models added, rolled and the bounds changed (removed models stay in it until they are forgotten)."""
    models = tuple(changes.rolled[m.name][0] if m.name in changes.rolled else
                   dataclasses.replace(m, **{k: getattr(changes.bounds[m.name], k) for k in MODEL_AT_ONCE})
                   if m.name in changes.bounds else m for m in running.models)
    return dataclasses.replace(running, models=(*models, *changes.added),
                               **{key: new for key, (_, new) in changes.at_once.items()})


def _bounds(model: ModelConfig) -> str:
    low, high = model.bounds
    return str(low) if low == high else f"{low}..{high}"


def _shown(value: Any) -> str:
    """A setting's value in one line: the tenants section by the tenants it declares."""
    if isinstance(value, Tenants):
        return f"{len(value.declared)} tenant(s) declared" if value.declared else "no tenant declared"
    if value is None:
        return "none"
    return str(value)
