"""A request's reuse namespace (its salt): what it may reuse of what other requests computed.

    broker: REQUEST (tenant, cache_salt, adapters) ──reuse_salt──▶ salt ──▶ ASSIGN.salt ──▶ the worker's engine
            routing: a slot's last prompt counts under the same salt; block hashes are keyed with it
    engine: a slot's cells reused, copied or kept, a host store entry saved or restored: under the same salt only

The default tenant ("": the local user, or a gateway without API keys) with no ``cache_salt`` and no adapters has
the empty salt: a pool with one tenant shares every prefix as it always did. Any other request gets a digest: of
its tenant, so that nothing computed for one tenant is reused for another (a reused prefix shows in
``cached_tokens`` and in the time to the first token, an oracle of other tenants' prompts); or of its
``cache_salt`` instead of the tenant (vLLM's field), so that the tenants that name one salt share deliberately (a
public system prompt, say). The adapter set and its scales are always in it: cells computed with a LoRA adapter
are not the base model's. A salt is the only thing derived from a tenant that reaches the workers.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

SALT_BYTES = 16  # a digest's length (the wire takes up to 32)
_VERSION = "mpserve-reuse/1"


def reuse_salt(tenant: str, cache_salt: str | None, adapters: Sequence[tuple[str, float]]) -> bytes:
    """The salt of a request of ``tenant`` naming ``cache_salt`` (None: none) with ``adapters`` (name, scale): b""
    for the default tenant with neither, else a digest in which ``cache_salt``, when given, replaces the tenant.
    The adapters count as a set: their order does not change the salt."""
    if not tenant and cache_salt is None and not adapters:
        return b""
    scope = ["cache_salt", cache_salt] if cache_salt is not None else ["tenant", tenant]
    named = sorted([name, float(scale)] for name, scale in adapters)
    text = json.dumps([_VERSION, scope, named], ensure_ascii=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=SALT_BYTES).digest()
