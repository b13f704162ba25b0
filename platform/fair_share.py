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

Places: when the batch is full, `place_move` says which waiting tenant takes a place
from which running tenant (max-min fair places per weight; platform/scheduling_policy.py).

Semantics: counters are floats in tokens / weight; `charge(tenant, tokens, weight)`
adds `tokens / weight`; `activate(tenant, active)` lifts; `next_tenant(heads)` picks;
`order(requests)` is the waiting requests in that order.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Protocol, TypeVar


class Queued(Protocol):
    """What fair share reads of a waiting request."""

    tenant: str
    arrival_time: float


Q = TypeVar("Q", bound=Queued)


def tenant_queues(requests: Iterable[Q]) -> dict[str, deque[Q]]:
    """Each tenant's requests, in the given order (FCFS within a tenant)."""
    queues: dict[str, deque[Q]] = {}
    for request in requests:
        queues.setdefault(request.tenant, deque()).append(request)
    return queues


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

    def order(self, requests: Iterable[Q]) -> Iterator[Q]:
        """`requests` (in FCFS order) in admission order: each time the head of the
        `next_tenant`'s queue; charges made between two items count for the next."""
        queues = tenant_queues(requests)
        while queues:
            tenant = self.next_tenant({t: queue[0].arrival_time for t, queue in queues.items()})
            queue = queues[tenant]
            yield queue.popleft()
            if not queue:
                del queues[tenant]

    def place_move(
        self,
        places: Counter[str],
        weights: Mapping[str, float],
        heads: Mapping[str, Q],
        may_start: Callable[[Q], bool],
    ) -> tuple[str, str] | None:
        """(claimant, donor): the waiting tenant with the fewest places per weight (then
        the lowest counter) and the running tenant with the most, when moving one place
        leaves the claimant with no more places per weight than the donor. None when no
        move is fair. `places`: running requests per tenant; `heads`: each waiting
        tenant's next request; a claimant whose head may not start (`may_start` says,
        e.g. its adapter would find no slot) is passed over for the next one."""
        if not heads or not places:
            return None
        donor = max(places, key=lambda t: (places[t] / weights[t], self.counter(t)))
        for claimant in sorted(heads, key=lambda t: (places[t] / weights[t], self.counter(t))):
            if claimant == donor:
                continue
            if (places[claimant] + 1) / weights[claimant] > (places[donor] - 1) / weights[donor]:
                return None
            if may_start(heads[claimant]):
                return claimant, donor
        return None
