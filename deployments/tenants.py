"""Tenants: API keys -> tenant, what each tenant may use, and its rate limits.

Keys are never stored in clear: the config lists SHA-256 digests, or names environment
variables whose values are hashed when the app starts. A presented key is hashed and
looked up, so comparison time does not depend on how much of a key matches.

With no tenants configured, authentication is off and every caller is the anonymous
tenant, allowed every base model and shared adapter (a single-team setup).
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, field_validator

from loraplex.adapters.sources import AdapterSource

TENANT_NAME = r"^[a-z0-9][a-z0-9_-]{0,62}$"
ANONYMOUS = "anonymous"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class ApiKeys(BaseModel):
    """API keys as a config lists them: digests, or environment variables to hash."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    api_key_sha256: list[str] = Field(
        default_factory=list, description="hex SHA-256 digests of the API keys"
    )
    api_key_env: list[str] = Field(
        default_factory=list, description="environment variables holding API keys in clear"
    )

    @field_validator("api_key_sha256")
    @classmethod
    def _hex_digests(cls, digests: list[str]) -> list[str]:
        for digest in digests:
            if not re.fullmatch(r"[0-9a-f]{64}", digest):
                raise ValueError("api_key_sha256 entries must be 64 lowercase hex digits")
        return digests

    def key_digests(self) -> list[str]:
        """Every accepted key's digest; an unset environment variable is an error."""
        digests = list(self.api_key_sha256)
        for variable in self.api_key_env:
            value = os.environ.get(variable)
            if not value:
                raise ValueError(f"{self._owner()}: environment variable {variable} is unset")
            digests.append(hash_key(value))
        return digests

    def _owner(self) -> str:
        return "operator"


class TenantConfig(ApiKeys):
    """One tenant as serve_config.yaml declares it."""

    name: str = Field(pattern=TENANT_NAME, description="tenant id; scopes its adapter names")
    models: list[str] = Field(
        default_factory=lambda: ["*"], description="base models it may call ('*': all)"
    )
    shared_adapters: list[str] = Field(
        default_factory=list,
        description="shared adapters it may call: 'base:adapter', 'base:*' or '*:*'",
    )
    max_concurrent_requests: int | None = Field(None, ge=1, description="in-flight requests")
    tokens_per_minute: int | None = Field(
        None,
        ge=1,
        description="prompt + generated tokens per rolling minute; a request's worst case "
        "(prompt + n x max_tokens) is reserved at admission and settled when it ends",
    )
    max_adapters: int = Field(64, ge=0, description="adapters it may register")
    adapter_sources: list[AdapterSource] = Field(
        default_factory=list,
        description="URI prefixes it may register adapters from, with their credentials "
        "(adapters/sources.py); none: folders under its adapter root only",
    )
    tokenize_requests_per_minute: int | None = Field(
        600,
        ge=1,
        description="/v1/tokenize and /v1/detokenize calls per rolling minute (each also "
        "holds one of its max_concurrent_requests while it runs); null: no limit",
    )
    admin_requests_per_minute: int | None = Field(
        60,
        ge=1,
        description="adapter register, unload and delete calls per rolling minute; null: no limit",
    )
    weight: float = Field(
        1.0,
        gt=0,
        le=1000,
        description="fair-share weight: under overload a model's engine serves tenants "
        "tokens in proportion to their weights (platform/fair_share.py)",
    )

    def _owner(self) -> str:
        return f"tenant {self.name!r}"


class OperatorConfig(ApiKeys):
    """The operator's credentials: they unlock the full /metrics (tenant and adapter
    labels) for Prometheus (`authorization: {credentials: <key>}` in a scrape config)."""


@dataclass(frozen=True)
class Tenant:
    name: str
    models: frozenset[str]
    shared_adapters: frozenset[str]
    max_concurrent_requests: int | None = None
    tokens_per_minute: int | None = None
    max_adapters: int = 64
    weight: float = 1.0
    tokenize_requests_per_minute: int | None = None
    admin_requests_per_minute: int | None = None
    adapter_sources: tuple[AdapterSource, ...] = ()

    def may_use_base(self, base: str) -> bool:
        return "*" in self.models or base in self.models

    def may_use_shared(self, base: str, adapter: str) -> bool:
        if not self.may_use_base(base):
            return False
        allowed = self.shared_adapters
        return bool({f"{base}:{adapter}", f"{base}:*", "*:*"} & allowed)

    @classmethod
    def anonymous(cls, adapter_sources: tuple[AdapterSource, ...] = ()) -> Tenant:
        return cls(ANONYMOUS, frozenset({"*"}), frozenset({"*:*"}), adapter_sources=adapter_sources)


class AuthError(Exception):
    """401: no key, or a key no tenant holds."""


class Tenants:
    def __init__(
        self, configs: list[TenantConfig], anonymous_sources: tuple[AdapterSource, ...] = ()
    ) -> None:
        """`anonymous_sources`: the adapter sources of every caller when no tenant is
        configured (authentication off)."""
        self._by_digest: dict[str, Tenant] = {}
        for config in configs:
            tenant = Tenant(
                name=config.name,
                models=frozenset(config.models),
                shared_adapters=frozenset(config.shared_adapters),
                max_concurrent_requests=config.max_concurrent_requests,
                tokens_per_minute=config.tokens_per_minute,
                max_adapters=config.max_adapters,
                weight=config.weight,
                tokenize_requests_per_minute=config.tokenize_requests_per_minute,
                admin_requests_per_minute=config.admin_requests_per_minute,
                adapter_sources=tuple(config.adapter_sources),
            )
            for digest in config.key_digests():
                if digest in self._by_digest:
                    raise ValueError(f"an API key of tenant {config.name!r} is used twice")
                self._by_digest[digest] = tenant
        self.auth_enabled = bool(configs)
        self._anonymous = Tenant.anonymous(anonymous_sources)

    def named(self, name: str) -> Tenant | None:
        """The tenant called `name` (the anonymous one when authentication is off)."""
        if not self.auth_enabled:
            return self._anonymous if name == ANONYMOUS else None
        return next((t for t in self._by_digest.values() if t.name == name), None)

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant holding the `Authorization: Bearer <key>` key; AuthError if none."""
        if not self.auth_enabled:
            return self._anonymous
        digest = bearer_digest(authorization)
        if digest is None:
            raise AuthError("missing API key: send 'Authorization: Bearer <key>'")
        tenant = self._by_digest.get(digest)
        if tenant is None:
            raise AuthError("invalid API key")
        return tenant


@dataclass
class _Usage:
    in_flight: int = 0
    tokens: deque[tuple[float, int]] = field(default_factory=deque)
    tokens_in_window: int = 0
    reserved: int = 0
    """Worst-case tokens of the requests in flight, not yet booked in the window."""
    calls: dict[str, deque[float]] = field(default_factory=dict)
    """Per call kind (tokenize, admin): when its calls of the last minute came, at most
    its per-minute limit of them."""


class RateLimited(Exception):
    """429 with the seconds after which a retry may pass."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def bearer_digest(authorization: str | None) -> str | None:
    """SHA-256 of the key in an `Authorization: Bearer <key>` header, or None."""
    if not authorization or not authorization.lower().startswith("bearer "):
        return None
    return hash_key(authorization[7:].strip())


class RateLimiter:
    """Per-tenant concurrency and tokens-per-minute limits of one ingress replica.

    `admit` takes a slot per sequence the request runs (prompts x n) and reserves the
    request's worst-case tokens (at most the whole budget; 429 when the tenant's
    sequences in flight leave no room for these, or when its last
    minute's tokens plus what its requests in flight have reserved leave no room);
    `settle` replaces the reservation with the exact worst case once the model server
    has counted the prompt; `release` returns the slot and the reservation and books
    the tokens the request used. With several ingress replicas each enforces the limits
    on its own share.

    Calls that generate nothing (tokenize, adapter admin) count against a per-minute
    rate of their kind instead (`count_call`); tokenize calls also hold a concurrency
    slot while they run (`admit_call` / `release_call`).
    """

    WINDOW_S = 60.0

    def __init__(self) -> None:
        self._usage: dict[str, _Usage] = {}
        self._lock = threading.Lock()

    def admit(self, tenant: Tenant, tokens: int = 0, sequences: int = 1) -> int:
        """Admits a request of `sequences` sequences that may use up to `tokens`;
        returns the tokens reserved. A request larger than the limit alone passes only
        with nothing else in flight (the ingress refuses those with a 400 first)."""
        with self._lock:
            usage = self._usage.setdefault(tenant.name, _Usage())
            self._expire(usage, time.monotonic())
            limit = tenant.max_concurrent_requests
            if limit is not None and usage.in_flight > 0 and usage.in_flight + sequences > limit:
                raise RateLimited(
                    f"tenant {tenant.name!r} has {usage.in_flight} sequences in flight and "
                    f"this request runs {sequences} (limit {limit})",
                    retry_after_s=1,
                )
            budget = tenant.tokens_per_minute
            reserve = 0
            if budget is not None:
                reserve = min(max(tokens, 0), budget)
                committed = usage.tokens_in_window + usage.reserved
                if committed > 0 and (committed >= budget or committed + reserve > budget):
                    raise RateLimited(
                        f"tenant {tenant.name!r} used {usage.tokens_in_window} tokens in the "
                        f"last minute and has {usage.reserved} reserved by requests in flight; "
                        f"this request may use up to {reserve} (limit {budget})",
                        retry_after_s=self._retry_after(usage),
                    )
                usage.reserved += reserve
            usage.in_flight += sequences
            return reserve

    def settle(self, tenant: Tenant, reserved: int, tokens: int) -> int:
        """Replaces a reservation of `reserved` with one of `tokens` (capped at the
        budget); returns the new reservation."""
        budget = tenant.tokens_per_minute
        new = min(max(tokens, 0), budget) if budget is not None else 0
        with self._lock:
            usage = self._usage.setdefault(tenant.name, _Usage())
            usage.reserved = max(0, usage.reserved - reserved + new)
        return new

    def release(self, tenant: Tenant, tokens: int, reserved: int = 0, sequences: int = 1) -> None:
        with self._lock:
            usage = self._usage.setdefault(tenant.name, _Usage())
            usage.in_flight = max(0, usage.in_flight - sequences)
            usage.reserved = max(0, usage.reserved - reserved)
            if tokens > 0:
                usage.tokens.append((time.monotonic(), tokens))
                usage.tokens_in_window += tokens

    def count_call(self, tenant: Tenant, kind: str, per_minute: int | None) -> None:
        """Books one call of `kind`; 429 when the tenant made `per_minute` of them in
        the last minute (None: no limit)."""
        if per_minute is None:
            return
        with self._lock:
            usage = self._usage.setdefault(tenant.name, _Usage())
            self._count_call(tenant, usage, kind, per_minute)

    def admit_call(self, tenant: Tenant, kind: str, per_minute: int | None) -> None:
        """Books one call of `kind` (as `count_call`) that holds one concurrency slot
        until `release_call`; 429 when the tenant's slots are all taken."""
        with self._lock:
            usage = self._usage.setdefault(tenant.name, _Usage())
            limit = tenant.max_concurrent_requests
            if limit is not None and usage.in_flight >= limit:
                raise RateLimited(
                    f"tenant {tenant.name!r} has {usage.in_flight} sequences in flight "
                    f"(limit {limit})",
                    retry_after_s=1,
                )
            if per_minute is not None:
                self._count_call(tenant, usage, kind, per_minute)
            usage.in_flight += 1

    def release_call(self, tenant: Tenant) -> None:
        self.release(tenant, 0)

    def _count_call(self, tenant: Tenant, usage: _Usage, kind: str, per_minute: int) -> None:
        now = time.monotonic()
        calls = usage.calls.setdefault(kind, deque())
        while calls and calls[0] <= now - self.WINDOW_S:
            calls.popleft()
        if len(calls) >= per_minute:
            raise RateLimited(
                f"tenant {tenant.name!r} made {len(calls)} {kind} calls in the last minute "
                f"(limit {per_minute})",
                retry_after_s=max(1, int(calls[0] + self.WINDOW_S - now) + 1),
            )
        calls.append(now)

    def in_use(self, tenant: Tenant) -> tuple[int, int]:
        """(requests in flight, tokens reserved) of a tenant."""
        with self._lock:
            usage = self._usage.get(tenant.name, _Usage())
            return usage.in_flight, usage.reserved

    def _retry_after(self, usage: _Usage) -> int:
        """Seconds until the oldest booked tokens leave the window (1 when only
        reservations of requests in flight stand in the way)."""
        if not usage.tokens:
            return 1
        oldest = usage.tokens[0][0]
        return max(1, int(oldest + self.WINDOW_S - time.monotonic()) + 1)

    def _expire(self, usage: _Usage, now: float) -> None:
        while usage.tokens and usage.tokens[0][0] <= now - self.WINDOW_S:
            usage.tokens_in_window -= usage.tokens.popleft()[1]
