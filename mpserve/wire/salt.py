"""A request's cache key: what it may reuse of what other requests computed. One path, in three hops, each in the
process that alone knows its part, all three here:

    gateway  keyed caller, tenant not known to the broker ──fallback_salt──▶ cache_salt "tenant:…" / "shared:…"
       │     (Backend.for_tenant could not reach the admin socket: the request goes as the gateway's own)
       ▼     REQUEST (tenant, cache_salt, adapters by name and scale)
    broker   ──reuse_salt(tenant, cache_salt, adapters)──▶ salt: b"" or a digest ──▶ ASSIGN.salt
       │     routing: a slot's last prompt counts under the same salt; block hashes are keyed with it
       ▼
    engine   ──reuse_key(salt, space)──▶ key: the salt, with the adapters' loads mixed in (``space``, when any)
             a slot's cells reused, copied or kept, a host store entry saved or restored: under the same key only

The default tenant ("": the local user, or a gateway without API keys) with no ``cache_salt`` and no adapters has
the empty salt: a pool with one tenant shares every prefix as it always did. Any other request gets a digest: of
its tenant, so that nothing computed for one tenant is reused for another (a reused prefix shows in
``cached_tokens`` and in the time to the first token, an oracle of other tenants' prompts); or of its
``cache_salt`` instead of the tenant (vLLM's field), so that the tenants that name one salt share deliberately (a
public system prompt, say). The adapter set and its scales are always in it: cells computed with a LoRA adapter
are not the base model's. A salt is the only thing derived from a tenant that reaches the workers; the engine adds
what only it knows, which load of each adapter the cells were computed under (an adapter unloaded and loaded again
from another file never meets cells of the first).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Sequence

SALT_BYTES = 16  # a digest's length (the wire takes up to 32)
_VERSION = "mpserve-reuse/1"


def fallback_salt(secret: bytes, tenant: str, cache_salt: str | None) -> str:
    """Hop 1, the gateway's: the cache_salt of a keyed caller's request sent as the gateway's own (the broker does
    not know its tenant): the caller's under a prefix of its own, or without one a digest of its tenant keyed with
    ``secret``, the gateway process's, so that no caller can name another tenant's (every caller may name any salt:
    a tenant's prompts are shared by its requests through this gateway process only)."""
    if cache_salt is not None:
        return f"shared:{cache_salt}"
    return "tenant:" + hmac.new(secret, tenant.encode(), hashlib.sha256).hexdigest()[:32]


def reuse_salt(tenant: str, cache_salt: str | None, adapters: Sequence[tuple[str, float]]) -> bytes:
    """Hop 2, the broker's: the salt of a request of ``tenant`` naming ``cache_salt`` (None: none) with ``adapters``
    (name, scale): b"" for the default tenant with neither, else a digest in which ``cache_salt``, when given,
    replaces the tenant. The adapters count as a set: their order does not change the salt."""
    if not tenant and cache_salt is None and not adapters:
        return b""
    scope = ["cache_salt", cache_salt] if cache_salt is not None else ["tenant", tenant]
    named = sorted([name, float(scale)] for name, scale in adapters)
    text = json.dumps([_VERSION, scope, named], ensure_ascii=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=SALT_BYTES).digest()


def reuse_key(salt: bytes, space: bytes) -> bytes:
    """Hop 3, the engine's: the key a sequence's cells are reused under: the request's salt, with the loads of the
    adapters it runs under (``space``, ``engine.adapters``) mixed in when it has any."""
    return salt if not space else hashlib.sha256(b"adapters\0" + salt + b"\0" + space).digest()[:16]
