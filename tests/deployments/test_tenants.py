"""API keys -> tenants (hashed), ACLs and per-tenant limits, without Ray."""

from __future__ import annotations

import pytest

from loraplex.deployments.tenants import (
    AuthError,
    RateLimited,
    RateLimiter,
    TenantConfig,
    Tenants,
    hash_key,
)


def test_keys_are_matched_by_hash_and_env_keys_work(monkeypatch):
    monkeypatch.setenv("GLOBEX_KEY", "sk-globex")
    tenants = Tenants(
        [
            TenantConfig(name="acme", api_key_sha256=[hash_key("sk-acme")]),
            TenantConfig(name="globex", api_key_env=["GLOBEX_KEY"]),
        ]
    )
    assert tenants.authenticate("Bearer sk-acme").name == "acme"
    assert tenants.authenticate("bearer sk-globex").name == "globex"
    for header in (None, "", "Basic sk-acme", "Bearer sk-acm", "Bearer " + hash_key("sk-acme")):
        with pytest.raises(AuthError):
            tenants.authenticate(header)


def test_unset_key_variable_and_bad_digest_fail_config(monkeypatch):
    monkeypatch.delenv("NOPE_KEY", raising=False)
    with pytest.raises(ValueError, match="NOPE_KEY is unset"):
        TenantConfig(name="x", api_key_env=["NOPE_KEY"]).key_digests()
    with pytest.raises(ValueError, match="64 lowercase hex"):
        TenantConfig(name="x", api_key_sha256=["abc"])
    with pytest.raises(ValueError, match="used twice"):
        Tenants(
            [
                TenantConfig(name="a", api_key_sha256=[hash_key("k")]),
                TenantConfig(name="b", api_key_sha256=[hash_key("k")]),
            ]
        )


def test_without_tenants_everyone_is_anonymous_with_full_access():
    tenant = Tenants([]).authenticate(None)
    assert tenant.name == "anonymous"
    assert tenant.may_use_base("any") and tenant.may_use_shared("any", "adapter")


def test_acl_on_bases_and_shared_adapters():
    tenants = Tenants(
        [
            TenantConfig(
                name="acme",
                api_key_sha256=[hash_key("k")],
                models=["m1"],
                shared_adapters=["m1:french", "m2:*"],
            )
        ]
    )
    acme = tenants.authenticate("Bearer k")
    assert acme.may_use_base("m1") and not acme.may_use_base("m2")
    assert acme.may_use_shared("m1", "french") and not acme.may_use_shared("m1", "pirate")
    assert not acme.may_use_shared("m2", "french"), "the base itself is not allowed"


def test_concurrency_and_token_limits_give_retry_after():
    tenant = Tenants(
        [
            TenantConfig(
                name="t",
                api_key_sha256=[hash_key("k")],
                max_concurrent_requests=1,
                tokens_per_minute=10,
            )
        ]
    ).authenticate("Bearer k")
    limiter = RateLimiter()
    limiter.admit(tenant)
    with pytest.raises(RateLimited, match="in flight") as error:
        limiter.admit(tenant)
    assert error.value.retry_after_s >= 1
    limiter.release(tenant, tokens=12)
    with pytest.raises(RateLimited, match="tokens in the last minute") as error:
        limiter.admit(tenant)
    assert 1 <= error.value.retry_after_s <= 61
    limiter.WINDOW_S = 0.0
    limiter.admit(tenant)
