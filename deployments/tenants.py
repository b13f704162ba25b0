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

TENANT_NAME = r"^[a-z0-9][a-z0-9_-]{0,62}$"
ANONYMOUS = "anonymous"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class TenantConfig(BaseModel):
    """One tenant as serve_config.yaml declares it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=TENANT_NAME, description="tenant id; scopes its adapter names")
    api_key_sha256: list[str] = Field(
        default_factory=list, description="hex SHA-256 digests of the tenant's API keys"
    )
    api_key_env: list[str] = Field(
        default_factory=list, description="environment variables holding API keys in clear"
    )
    models: list[str] = Field(
        default_factory=lambda: ["*"], description="base models it may call ('*': all)"
    )
    shared_adapters: list[str] = Field(
        default_factory=list,
        description="shared adapters it may call: 'base:adapter', 'base:*' or '*:*'",
    )
    max_concurrent_requests: int | None = Field(None, ge=1, description="in-flight requests")
    tokens_per_minute: int | None = Field(
        None, ge=1, description="prompt + generated tokens per rolling minute"
    )
    max_adapters: int = Field(64, ge=0, description="adapters it may register")

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
                raise ValueError(f"tenant {self.name!r}: environment variable {variable} is unset")
            digests.append(hash_key(value))
        return digests


@dataclass(frozen=True)
class Tenant:
    name: str
    models: frozenset[str]
    shared_adapters: frozenset[str]
    max_concurrent_requests: int | None = None
    tokens_per_minute: int | None = None
    max_adapters: int = 64

    def may_use_base(self, base: str) -> bool:
        return "*" in self.models or base in self.models

    def may_use_shared(self, base: str, adapter: str) -> bool:
        if not self.may_use_base(base):
            return False
        allowed = self.shared_adapters
        return bool({f"{base}:{adapter}", f"{base}:*", "*:*"} & allowed)

    @classmethod
    def anonymous(cls) -> Tenant:
        return cls(ANONYMOUS, frozenset({"*"}), frozenset({"*:*"}))


class AuthError(Exception):
    """401: no key, or a key no tenant holds."""


class Tenants:
    def __init__(self, configs: list[TenantConfig]) -> None:
        self._by_digest: dict[str, Tenant] = {}
        for config in configs:
            tenant = Tenant(
                name=config.name,
                models=frozenset(config.models),
                shared_adapters=frozenset(config.shared_adapters),
                max_concurrent_requests=config.max_concurrent_requests,
                tokens_per_minute=config.tokens_per_minute,
                max_adapters=config.max_adapters,
            )
            for digest in config.key_digests():
                if digest in self._by_digest:
                    raise ValueError(f"an API key of tenant {config.name!r} is used twice")
                self._by_digest[digest] = tenant
        self.auth_enabled = bool(configs)
        self._anonymous = Tenant.anonymous()

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant holding the `Authorization: Bearer <key>` key; AuthError if none."""
        if not self.auth_enabled:
            return self._anonymous
        if not authorization or not authorization.lower().startswith("bearer "):
            raise AuthError("missing API key: send 'Authorization: Bearer <key>'")
        tenant = self._by_digest.get(hash_key(authorization[7:].strip()))
        if tenant is None:
            raise AuthError("invalid API key")
        return tenant


@dataclass
class _Usage:
    in_flight: int = 0
    tokens: deque[tuple[float, int]] = field(default_factory=deque)
    tokens_in_window: int = 0


class RateLimited(Exception):
    """429 with the seconds after which a retry may pass."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RateLimiter:
    """Per-tenant concurrency and tokens-per-minute limits of one ingress replica.

    `admit` reserves a request slot (429 when the tenant is at its limit or its last
    minute's tokens reached its budget); `release` returns it and books the tokens the
    request used. With several ingress replicas each enforces the limits on its own share.
    """

    WINDOW_S = 60.0

    def __init__(self) -> None:
        self._usage: dict[str, _Usage] = {}
        self._lock = threading.Lock()

    def admit(self, tenant: Tenant) -> None:
        with self._lock:
            usage = self._usage.setdefault(tenant.name, _Usage())
            self._expire(usage, time.monotonic())
            limit = tenant.max_concurrent_requests
            if limit is not None and usage.in_flight >= limit:
                raise RateLimited(
                    f"tenant {tenant.name!r} has {usage.in_flight} requests in flight "
                    f"(limit {limit})",
                    retry_after_s=1,
                )
            budget = tenant.tokens_per_minute
            if budget is not None and usage.tokens_in_window >= budget:
                oldest = usage.tokens[0][0]
                wait = max(1, int(oldest + self.WINDOW_S - time.monotonic()) + 1)
                raise RateLimited(
                    f"tenant {tenant.name!r} used {usage.tokens_in_window} tokens in the last "
                    f"minute (limit {budget})",
                    retry_after_s=wait,
                )
            usage.in_flight += 1

    def release(self, tenant: Tenant, tokens: int) -> None:
        with self._lock:
            usage = self._usage.setdefault(tenant.name, _Usage())
            usage.in_flight = max(0, usage.in_flight - 1)
            if tokens > 0:
                usage.tokens.append((time.monotonic(), tokens))
                usage.tokens_in_window += tokens

    def _expire(self, usage: _Usage, now: float) -> None:
        while usage.tokens and usage.tokens[0][0] <= now - self.WINDOW_S:
            usage.tokens_in_window -= usage.tokens.popleft()[1]
