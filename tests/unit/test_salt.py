"""The reuse salt (``mpserve.wire.salt``): empty for the one default tenant, a digest that separates tenants
otherwise, shared through a named cache_salt, always holding the adapter set."""

from mpserve.wire.salt import SALT_BYTES, reuse_salt

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
