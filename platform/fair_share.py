"""Tenant fair share: the virtual token counter (VTC) the scheduler admits by.

Each tenant has a counter of the tokens the engine served it: prompt tokens it computed
for the tenant (charged when a request is admitted, never again after a preemption)
and output tokens (charged as they are sampled), each divided by the tenant's weight.
With the `fair` policy, the scheduler fills free batch places from the waiting tenant
whose counter is lowest, first come first served within a tenant. A tenant sending ten
times another's load thus gets no more than its share while the other has work, and
all the spare capacity while it has none (the engine is never idle while anyone waits).

Credit cannot be banked: when a tenant becomes active (its first request in the engine
after it had none) its counter is lifted to the lowest counter among the tenants
already active, so an idle stretch does not buy it a burst that starves the others.
With one tenant (offline use, or a single-team deployment) the order is plain FCFS.

Semantics: counters are floats in tokens / weight; `charge(tenant, tokens, weight)`
adds `tokens / weight`; `activate(tenant, active)` lifts; `next_tenant(heads)` picks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


class FairShare:
    """Virtual token counters per tenant (module docstring)."""

    def __init__(self) -> None:
        self._counters: dict[str, float] = {}

    def counter(self, tenant: str) -> float:
        return self._counters.get(tenant, 0.0)

    def counters(self) -> dict[str, float]:
        """Every tenant's counter (a copy): what the engine's stats publish."""
        return dict(self._counters)

    def charge(self, tenant: str, tokens: int, weight: float = 1.0) -> None:
        """Books `tokens` served to `tenant`, scaled down by its weight (> 0)."""
        if tokens > 0:
            self._counters[tenant] = self.counter(tenant) + tokens / weight

    def activate(self, tenant: str, active: Iterable[str]) -> None:
        """`tenant` has its first request in the engine; `active` are the tenants that
        already had one. Lifts its counter to the lowest of theirs, if that is higher."""
        floor = min((self.counter(other) for other in active if other != tenant), default=None)
        if floor is not None and floor > self.counter(tenant):
            self._counters[tenant] = floor

    def clear(self) -> None:
        """Forgets every counter: the scheduler calls it once no tenant is active (there
        is nothing left to compare against), so the map does not grow without bound."""
        self._counters.clear()

    def next_tenant(self, heads: Mapping[str, float]) -> str:
        """Of the tenants with a waiting request (tenant -> its head's arrival time),
        the one to serve next: lowest counter, then earliest head."""
        return min(heads, key=lambda tenant: (self.counter(tenant), heads[tenant]))
