"""Which models a remote pool's key may serve: the ``worker_models`` setting, applied to the key each message on
the worker socket came with (ZeroMQ's CURVE handshake proved it; the authenticator gives it as the message's
``User-Id``, in Z85).

    worker_models {KEY: [MODEL, ...]} ──▶ KEY.key in curve_workers ──▶ its public key (Z85) ──▶ PoolKey
    READY from a remote pool ──▶ refusal: its key is named, and not with this model ──▶ refused, naming both

A key the setting does not name may serve any model the server serves, as before the setting.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import zmq.auth

from mpserve.errors import ConfigError


@dataclass(frozen=True)
class PoolKey:
    name: str  # its file's name in curve_workers, without .key
    models: tuple[str, ...]  # the models it may serve


def pool_keys(folder: str, limits: Mapping[str, tuple[str, ...]]) -> dict[str, PoolKey]:
    """The keys ``limits`` names, by their public key in Z85 (as a message's ``User-Id`` gives it)."""
    keys = {}
    for name, models in limits.items():
        path = Path(folder) / f"{name}.key"
        try:
            public, _ = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"worker_models: {name}: cannot read the public key {path} ({exc}); name keys by "
                              f"their file in curve_workers without .key, or create it with `mpserve keygen {folder} "
                              f"{name}`") from None
        keys[public.decode()] = PoolKey(name, models)
    return keys


def refusal(key: PoolKey | None, model: str) -> str | None:
    """Why a pool with ``key`` (None: a key the setting does not name) may not serve ``model`` (None: it may)."""
    if key is None or model in key.models:
        return None
    allowed = ", ".join(key.models) or "no model"
    return (f"its key {key.name} may serve {allowed}, not {model} (worker_models in the server's configuration; "
            f"add {model} to the key's list there to allow it)")
