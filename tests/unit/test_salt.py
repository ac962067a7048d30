"""The cache key (``mpserve.wire.salt``), hop by hop: the gateway's fallback salt keeps tenants apart without the
broker; the reuse salt is empty for the one default tenant, a digest that separates tenants otherwise, shared
through a named cache_salt, always holding the adapter set; the engine's key mixes in the adapters' loads."""

from mpserve.wire.salt import SALT_BYTES, fallback_salt, reuse_key, reuse_salt

A, B = "key:" + "a" * 16, "key:" + "b" * 16


def test_the_default_tenant_without_salt_or_adapters_has_the_empty_salt() -> None:
    assert reuse_salt("", None, ()) == b""


def test_tenants_get_salts_of_their_own() -> None:
    a, b = reuse_salt(A, None, ()), reuse_salt(B, None, ())
    assert len(a) == len(b) == SALT_BYTES
    assert a != b and b"" not in (a, b)
    assert reuse_salt(A, None, ()) == a  # stable: the same in every process


def test_a_cache_salt_replaces_the_tenant_so_tenants_naming_it_share() -> None:
    shared = reuse_salt(A, "public-system-prompt", ())
    assert shared == reuse_salt(B, "public-system-prompt", ()) == reuse_salt("", "public-system-prompt", ())
    assert shared not in (reuse_salt(A, None, ()), reuse_salt(A, "another", ()), b"")
    assert reuse_salt("", "", ()) not in (b"", shared)  # an empty name is still a name


def test_a_cache_salt_never_equals_a_tenant_of_the_same_text() -> None:
    assert reuse_salt("x", None, ()) != reuse_salt("", "x", ())


def test_the_adapter_set_and_its_scales_are_always_in_the_salt() -> None:
    base = reuse_salt(A, "shared", ())
    one = reuse_salt(A, "shared", (("sql", 1.0),))
    assert one not in (base, reuse_salt(A, "shared", (("sql", 0.5),)), reuse_salt(B, None, (("sql", 1.0),)))
    assert reuse_salt("", None, (("sql", 1.0),)) != b""  # the default tenant too: the cells are not the base's
    assert reuse_salt(A, None, (("a", 1.0), ("b", 2.0))) == reuse_salt(A, None, (("b", 2.0), ("a", 1.0)))
    assert reuse_salt(B, "shared", (("sql", 1.0),)) == one


def test_the_gateways_fallback_keeps_tenants_apart_and_no_caller_can_name_a_tenants() -> None:
    secret, other = b"s" * 16, b"o" * 16
    a, b = fallback_salt(secret, A, None), fallback_salt(secret, B, None)
    assert a != b and a == fallback_salt(secret, A, None)
    assert a != fallback_salt(other, A, None)  # keyed with the gateway process's secret
    named = fallback_salt(secret, A, a)  # a caller that names a tenant's fallback gets a salt of its own
    assert named == fallback_salt(secret, B, a) and named not in (a, b)


def test_the_whole_path_gateway_broker_engine_keeps_tenants_and_adapter_loads_apart() -> None:
    secret, gateway = b"s" * 16, ""  # sent as the gateway's own: its tenant at the broker is the gateway's
    key_a = reuse_key(reuse_salt(gateway, fallback_salt(secret, A, None), ()), b"")
    key_b = reuse_key(reuse_salt(gateway, fallback_salt(secret, B, None), ()), b"")
    assert key_a != key_b and b"" not in (key_a, key_b)
    shared = [reuse_key(reuse_salt(gateway, fallback_salt(secret, t, "public"), ()), b"") for t in (A, B)]
    assert shared[0] == shared[1]  # a named cache_salt is shared through the fallback too
    salt = reuse_salt(A, None, (("sql", 1.0),))
    assert reuse_key(salt, b"") == salt  # the base model: the broker's salt as it came
    first, again = reuse_key(salt, b"load-1"), reuse_key(salt, b"load-2")
    assert first != again and salt not in (first, again)  # cells of one load never meet another's
    assert reuse_key(b"", b"load-1") not in (b"", first)
