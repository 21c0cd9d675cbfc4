"""API keys -> tenants: parsing, authentication, and the server-side cache salt."""

from __future__ import annotations

import pathlib

import pytest

from shared.errors import KvmeshError, Reason
from shared.tenants import ApiKeys, TenantLimits, end_user_digest

KEYS_FILE = """
[tenants.acme]
keys = ["sk-acme-1", "sk-acme-2"]
requests_per_second = 5
tokens_per_minute = 6000
max_concurrent = 2
highest_priority = -5
weight = 3

[tenants.beta]
keys = ["sk-beta"]
"""


@pytest.fixture
def keys(tmp_path: pathlib.Path) -> ApiKeys:
    path = tmp_path / "keys.toml"
    path.write_text(KEYS_FILE)
    return ApiKeys.from_toml(str(path))


def test_priority_above_a_tenants_allowance_is_permission_denied(keys: ApiKeys) -> None:
    acme = keys.authenticate([("x-api-key", "sk-acme-1")])
    beta = keys.authenticate([("x-api-key", "sk-beta")])
    assert (acme.highest_priority, acme.weight) == (-5, 3.0)
    assert (beta.highest_priority, beta.weight) == (0, 1.0)  # no key may jump the queue
    acme.check_priority(-5)
    beta.check_priority(0)
    beta.check_priority(7)  # less urgent is always allowed
    for tenant, priority in ((acme, -6), (beta, -1)):
        with pytest.raises(KvmeshError) as refused:
            tenant.check_priority(priority)
        assert refused.value.reason is Reason.PERMISSION_DENIED and not refused.value.retryable
        assert "priority" in refused.value.message
    ApiKeys().authenticate([]).check_priority(-(2**31))  # auth off: one user, any priority


def test_each_key_maps_to_its_tenant_and_limits(keys: ApiKeys) -> None:
    acme = keys.authenticate([("authorization", "Bearer sk-acme-2")])
    assert acme.name == "acme"
    assert acme.limits == TenantLimits(5.0, 6000.0, 2)
    beta = keys.authenticate([("x-api-key", "sk-beta")])
    assert beta.name == "beta" and beta.limits.unlimited


@pytest.mark.parametrize(
    "metadata",
    [[], [("authorization", "Bearer wrong")], [("authorization", "Basic sk-beta")]],
)
def test_missing_or_wrong_keys_are_unauthenticated(
    keys: ApiKeys, metadata: list[tuple[str, str]]
) -> None:
    with pytest.raises(KvmeshError) as raised:
        keys.authenticate(metadata)
    assert raised.value.reason is Reason.UNAUTHENTICATED
    assert "sk-" not in raised.value.message  # a key never appears in an error


def test_auth_off_runs_everything_as_anonymous() -> None:
    keys = ApiKeys.from_env("")
    assert not keys.enabled
    assert keys.authenticate([]).name == "anonymous"


def test_env_keys_and_their_errors() -> None:
    keys = ApiKeys.from_env("acme=k1, beta=k2")
    assert keys.authenticate([("authorization", "Bearer k2")]).name == "beta"
    with pytest.raises(KvmeshError):
        ApiKeys.from_env("no-equals-sign")


def test_each_tenant_has_its_own_stable_cache_salt(keys: ApiKeys) -> None:
    acme = keys.authenticate([("x-api-key", "sk-acme-1")])
    again = keys.authenticate([("x-api-key", "sk-acme-2")])
    beta = keys.authenticate([("x-api-key", "sk-beta")])
    assert acme.cache_salt == again.cache_salt  # same tenant, any key: shared cache
    assert acme.cache_salt != beta.cache_salt
    assert len(acme.cache_salt) == 16


def test_a_tenant_without_keys_is_refused(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text("[tenants.empty]\nkeys = []\n")
    with pytest.raises(KvmeshError, match="non-empty keys"):
        ApiKeys.from_toml(str(path))


def test_an_end_user_is_logged_as_a_digest_per_tenant() -> None:
    digest = end_user_digest("acme", "alice@example.com")
    assert len(digest) == 16 and "alice" not in digest
    assert digest == end_user_digest("acme", "alice@example.com")  # one user's requests group
    assert digest != end_user_digest("other", "alice@example.com")
    assert end_user_digest("acme", "") == ""


def test_defaults_give_each_tenant_the_limits_it_does_not_set(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(KEYS_FILE + "\n[defaults]\nmax_concurrent = 16\nmax_in_flight_tokens = 9000\n")
    tenants = {t.name: t for t in ApiKeys.from_toml(str(path)).tenants}
    assert tenants["acme"].limits == TenantLimits(5, 6000, 2, 9000)  # its own max_concurrent
    assert tenants["beta"].limits == TenantLimits(0, 0, 16, 9000)
    path.write_text(KEYS_FILE + "\n[defaults]\nmax_streams = 16\n")
    with pytest.raises(KvmeshError, match=r"\[defaults\] takes .*'max_streams'"):
        ApiKeys.from_toml(str(path))
