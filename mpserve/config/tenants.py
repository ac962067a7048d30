"""The ``tenants:`` section of the server's configuration: who the broker tells apart, and each one's share and
limits.

    tenants:
      key:3f2a9c0d11e4b5a6:        # an API key, by digest: "key:" + sha256(key).hexdigest()[:16]
        weight: 4                  # its share of slot time while others wait too (weighted fair queuing)
        max_priority: 10           # the highest ``priority`` its requests keep (higher ones are lowered to it)
        max_running: 8             # its requests running at once; more wait their turn in the queue
        max_queued: 64             # its requests waiting; one more is refused (busy, naming the limit)
        tokens_per_minute: 200000  # prompt and generated tokens of its requests that ended in the last 60 s
        max_images: 2              # images one request may carry; and max_image_bytes (e.g. 1MiB), max_image_pixels
                                   # (width × height) of each; max_audio_seconds (all of a request's audio clips):
                                   # below the gateway's, they lower them for this tenant
      "rq:Pz5t...":                # a CURVE client's public key (Z85, 40 characters), as its .key file holds it
        weight: 1
      local: {max_priority: 100}   # the local user on ipc, and the gateway's callers when it has no API key ("")
      default: {max_running: 4}    # every tenant not listed

The ``default`` entry is what an unlisted tenant gets (weight 1, max_priority 0, no limits, if it is absent too).
Without a ``tenants`` section every tenant has weight 1 and no limit; the local tenant may ask for any priority,
every other (an API key, a CURVE key) up to ``KEYED.max_priority`` (0), so that no key jumps the others' queues
by asking: a section raises it.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mpserve.config.sizes import parse_memory
from mpserve.errors import ConfigError
from mpserve.wire.media import BOUNDS, ImageLimits

LOCAL = ""  # the local user's tenant (ipc), written "local" or "" in the file
DEFAULT_ENTRY = "default"
MAX_PRIORITY = 100  # the wire's bound on ``priority``: -100..100
KEY_DIGEST_RE = re.compile(r"^key:[0-9a-f]{16}$")
CURVE_KEY_RE = re.compile(r"^[0-9A-Za-z.:+=^!/*?&<>()\[\]{}@%$#-]{40}$")  # a Z85 public key
_LIMITS = ("max_running", "max_queued", "tokens_per_minute")
_KEYS = ("weight", "max_priority", *_LIMITS, *BOUNDS)


@dataclass(frozen=True)
class Tenant:
    """One tenant's share and limits (None: no limit)."""

    weight: float = 1.0
    max_priority: int = MAX_PRIORITY
    max_running: int | None = None
    max_queued: int | None = None
    tokens_per_minute: int | None = None
    max_images: int | None = None  # the image limits (``wire.media``), each at most what the wire carries
    max_image_bytes: int | None = None
    max_image_pixels: int | None = None
    max_audio_seconds: int | None = None

    def images(self, name: str) -> ImageLimits | None:
        """The limits of this tenant's images and audio, named as tenant ``name``'s (the wire's bounds where it sets
        none); None when it sets none."""
        given = (self.max_images, self.max_image_bytes, self.max_image_pixels, self.max_audio_seconds)
        if given == (None, None, None, None):
            return None
        images, size, pixels, seconds = (bound if limit is None else limit
                                         for limit, bound in zip(given, BOUNDS.values(), strict=True))
        return ImageLimits(images, size, pixels, name, seconds)


UNCAPPED = Tenant()
KEYED = Tenant(max_priority=0)  # a tenant other than the local one, without a ``tenants`` section


@dataclass(frozen=True)
class Tenants:
    """Every declared tenant by its name (``LOCAL``, ``key:<16 hex>`` or a Z85 CURVE key), and the default."""

    declared: dict[str, Tenant] = field(default_factory=dict)
    default: Tenant = UNCAPPED

    def of(self, tenant: str) -> Tenant:
        return self.declared.get(tenant, self.default)


def parse_tenants(value: Any, where: str = "config: tenants") -> Tenants:
    """The ``tenants`` mapping of the file; a bad entry is a one-line ConfigError naming it and what is allowed."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: got {value!r}, expected a mapping of tenants (key:<16 hex digits of the API "
                          "key's sha256>, a CURVE public key, local, or default) to their settings")
    declared: dict[str, Tenant] = {}
    default = Tenant(max_priority=0)
    for name, entry in value.items():
        here = f"{where}.{name}"
        if name == DEFAULT_ENTRY:
            default = _tenant(entry, here)
            continue
        tenant = _name(name, here)
        if tenant in declared:
            raise ConfigError(f"{here}: the local user is declared twice (\"\" and local are one tenant)")
        declared[tenant] = _tenant(entry, here)
    return Tenants(declared, default)


def _name(name: Any, where: str) -> str:
    if name is None or name in ("", "local"):
        return LOCAL
    if isinstance(name, str) and (KEY_DIGEST_RE.match(name) or CURVE_KEY_RE.match(name)):
        return name
    raise ConfigError(f"{where}: not a tenant's name; name an API key by its digest, \"key:\" + the first 16 hex "
                      "digits of its sha256 (python -c \"import hashlib; print('key:' + hashlib.sha256(b'KEY')."
                      "hexdigest()[:16])\"), a CURVE client by its public key (the 40 characters of its .key file), "
                      "the local user as local, or every other tenant as default")


def _tenant(entry: Any, where: str) -> Tenant:
    if entry is None:
        entry = {}
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where}: got {entry!r}, expected a mapping of {', '.join(_KEYS)}")
    unknown = [k for k in entry if k not in _KEYS]
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; allowed keys: {', '.join(_KEYS)}")
    weight = entry.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0.01 <= weight <= 1000:
        raise ConfigError(f"{where}.weight: got {weight!r}, allowed: a number from 0.01 to 1000")
    ceiling = entry.get("max_priority", 0)
    if isinstance(ceiling, bool) or not isinstance(ceiling, int) or not -MAX_PRIORITY <= ceiling <= MAX_PRIORITY:
        raise ConfigError(f"{where}.max_priority: got {ceiling!r}, allowed: an integer from {-MAX_PRIORITY} to "
                          f"{MAX_PRIORITY}")
    limits: dict[str, int | None] = {}
    for key in _LIMITS:
        limit = entry.get(key)
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0
                                  or (key != "max_queued" and limit == 0)):
            least = 0 if key == "max_queued" else 1
            raise ConfigError(f"{where}.{key}: got {limit!r}, allowed: an integer of at least {least} (leave it "
                              "out for no limit)")
        limits[key] = limit
    return Tenant(float(weight), ceiling, **limits, **_image_limits(entry, where))


def _image_limits(entry: Mapping[str, Any], where: str) -> dict[str, int | None]:
    """The entry's image limits, each from 1 to what the wire carries (bytes also as a size, 1MiB)."""
    limits: dict[str, int | None] = {}
    for key, bound in BOUNDS.items():
        limit, sized = entry.get(key), key == "max_image_bytes"
        if sized and isinstance(limit, str):
            with contextlib.suppress(ConfigError):  # not a size: refused below
                limit = parse_memory(limit)
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= bound):
            what = "a byte count or a size such as 1MiB" if sized else "an integer"
            raise ConfigError(f"{where}.{key}: got {entry[key]!r}, allowed: {what} from 1 to {bound}, what the wire "
                              "carries (leave it out for the gateway's)")
        limits[key] = limit
    return limits
