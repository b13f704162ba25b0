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


def test_token_budget_reserves_the_worst_case_up_front():
    """Admission reserves a request's worst case; nothing can book past the budget by
    starting many requests before any of them ends."""
    tenant = Tenants(
        [TenantConfig(name="t", api_key_sha256=[hash_key("k")], tokens_per_minute=100)]
    ).authenticate("Bearer k")
    limiter = RateLimiter()
    first = limiter.admit(tenant, tokens=60)
    assert first == 60 and limiter.in_use(tenant) == (1, 60)
    with pytest.raises(RateLimited, match="60 reserved by requests in flight") as error:
        limiter.admit(tenant, tokens=50)
    assert error.value.retry_after_s == 1
    # The model server counted the prompt: the exact worst case is smaller.
    first = limiter.settle(tenant, first, 30)
    second = limiter.admit(tenant, tokens=50)
    assert limiter.in_use(tenant) == (2, 80)
    limiter.release(tenant, tokens=12, reserved=first)
    limiter.release(tenant, tokens=40, reserved=second)
    assert limiter.in_use(tenant) == (0, 0)
    with pytest.raises(RateLimited, match="used 52 tokens in the last minute"):
        limiter.admit(tenant, tokens=49)
    # One request larger than the whole budget reserves the budget (the model server
    # refuses it with a 400 once it knows the exact size).
    limiter.WINDOW_S = 0.0
    assert limiter.admit(tenant, tokens=10**9) == 100


def test_call_rates_are_per_kind_and_tokenize_holds_a_slot(monkeypatch):
    """Tokenize and admin calls count against per-minute rates of their own kinds; a
    tokenize call holds one of the tenant's concurrent slots while it runs; the window
    slides (the oldest call leaving frees a place)."""
    import loraplex.deployments.tenants as tenants_module

    now = [1000.0]
    monkeypatch.setattr(tenants_module.time, "monotonic", lambda: now[0])
    config = TenantConfig(
        name="t",
        api_key_sha256=[hash_key("k")],
        max_concurrent_requests=2,
        tokenize_requests_per_minute=2,
        admin_requests_per_minute=1,
    )
    tenant = Tenants([config]).authenticate("Bearer k")
    limits = RateLimiter()
    limits.count_call(tenant, "admin", tenant.admin_requests_per_minute)
    with pytest.raises(RateLimited, match="1 admin calls") as refused:
        limits.count_call(tenant, "admin", tenant.admin_requests_per_minute)
    assert refused.value.retry_after_s == 61
    limits.admit_call(tenant, "tokenize", tenant.tokenize_requests_per_minute)
    limits.admit_call(tenant, "tokenize", tenant.tokenize_requests_per_minute)
    assert limits.in_use(tenant) == (2, 0)
    with pytest.raises(RateLimited, match="in flight"):
        limits.admit(tenant, 0)
    limits.release_call(tenant)
    limits.release_call(tenant)
    with pytest.raises(RateLimited, match="2 tokenize calls"):
        limits.admit_call(tenant, "tokenize", tenant.tokenize_requests_per_minute)
    assert limits.in_use(tenant) == (0, 0)
    now[0] += 60.5
    limits.admit_call(tenant, "tokenize", tenant.tokenize_requests_per_minute)
    limits.count_call(tenant, "admin", tenant.admin_requests_per_minute)
    limits.count_call(tenant, "admin", None)
