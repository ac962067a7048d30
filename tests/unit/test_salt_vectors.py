"""A salt's and a cache key's exact bytes (``mpserve.wire.salt``: ``reuse_salt``, ``reuse_key``): digests of a fixed
text, so that a change of their encoding is a deliberate one (a new ``_VERSION``). Host store entries on disk and in
a remote tier outlive a server's upgrade under these keys: another encoding would miss every one of them."""

from __future__ import annotations

import hashlib

import pytest

from mpserve.wire.salt import SALT_BYTES, reuse_key, reuse_salt


def digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=SALT_BYTES).digest()


@pytest.mark.parametrize(("tenant", "cache_salt", "adapters", "text"), [
    ("key:" + "a" * 16, None, (), '["mpserve-reuse/1",["tenant","key:aaaaaaaaaaaaaaaa"],[]]'),
    ("key:" + "a" * 16, "pub lic", (("fr", 0.5), ("de", 1)),
     '["mpserve-reuse/1",["cache_salt","pub lic"],[["de",1.0],["fr",0.5]]]'),
    ("Zé", None, (("x", -1.5),), '["mpserve-reuse/1",["tenant","Z\\u00e9"],[["x",-1.5]]]'),
])
def test_a_salt_is_the_digest_of_its_version_scope_and_adapters_written_compactly_in_ascii(
        tenant: str, cache_salt: str | None, adapters: tuple[tuple[str, float], ...], text: str) -> None:
    assert reuse_salt(tenant, cache_salt, adapters) == digest(text)


def test_a_cache_key_is_the_salt_alone_or_with_the_adapters_loads_mixed_in() -> None:
    salt = reuse_salt("key:" + "a" * 16, None, (("fr", 1.0),))
    assert reuse_key(salt, b"") == salt
    assert reuse_key(salt, b"fr#3") == hashlib.sha256(b"adapters\0" + salt + b"\0fr#3").digest()[:16]
