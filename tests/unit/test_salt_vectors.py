"""A salt's exact bytes (``mpserve.wire.salt.reuse_salt``): the digest of a fixed text, so that a change of its
encoding is a deliberate one (a new ``_VERSION``). Host store entries on disk and in a remote tier outlive a
server's upgrade under these salts: another encoding would miss every one of them."""

from __future__ import annotations

import hashlib

import pytest

from mpserve.wire.salt import SALT_BYTES, reuse_salt


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
