"""Who the scheduler serves first: the hooks it calls, and their two policies.

`FcfsPolicy` (`policy: fcfs` and `priority`; the waiting queue's own order decides) and
`FairSharePolicy` (`policy: fair`, the virtual token counters of platform/fair_share.py):
waiting requests are admitted from the tenant with the fewest weighted tokens served
(FCFS within a tenant); each tenant is charged its computed prompt tokens at admission
and its sampled tokens after each step. When the batch is full, a waiting tenant may take
a place from the running tenant holding the most places per weight, as long as it then
still holds no more places per weight than that tenant (max-min fair places: a move is
never undone by the reverse move, so places do not churn). The place goes to the
claimant's head request this step; the donor's request with the least computed work is
preempted (its full blocks stay in the prefix cache for its recompute). A waiting tenant
with no prompt under way has its head request start in a free place first, and the step
keeps its prompt's tokens (and the claimants') from running requests' prefill chunks. A
light tenant's request thus starts at the next step, neither after a heavy tenant's
request ends nor after its long prompt. Under `fair` the slot gate (platform/scheduler.py)
starts in the first free place, ahead of the other tenants' heads, or in one its tenant
reclaims; a tenant head that finds no slot is passed over for the next tenant's.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Protocol

from loraplex.platform.fair_share import FairShare, tenant_queues
from loraplex.platform.request import Request

if TYPE_CHECKING:
    from loraplex.platform.scheduler import Scheduler


class SchedulingPolicy(Protocol):
    """The scheduler's hooks (each called where the scheduler's docstring says)."""

    def added(self, group: list[Request]) -> None:
        """A request group entered the engine."""

    def ended(self, request: Request) -> None:
        """A request left the engine (finished, aborted or failed)."""

    def waiting_order(self, waiting: Iterable[Request]) -> Iterator[Request]:
        """The waiting requests in the order they are admitted."""

    def charge(self, request: Request, tokens: int) -> None:
        """`tokens` were served to `request` (its prompt at admission, sampled tokens)."""

    def first_to_start(self, scheduler: Scheduler, preempted: list[Request]) -> list[Request]:
        """Waiting requests that start this step ahead of running prefill chunks (and
        of the waiting order), preempting into `preempted` the requests whose places
        they take."""


class FcfsPolicy:
    """The waiting queue's order (arrival, or priority then arrival); no tenant state."""

    def added(self, group: list[Request]) -> None:
        return None

    def ended(self, request: Request) -> None:
        return None

    def waiting_order(self, waiting: Iterable[Request]) -> Iterator[Request]:
        return iter(waiting)

    def charge(self, request: Request, tokens: int) -> None:
        return None

    def first_to_start(self, scheduler: Scheduler, preempted: list[Request]) -> list[Request]:
        return []


class FairSharePolicy:
    """Fair share among tenants (module docstring)."""

    def __init__(self) -> None:
        self.fair_share = FairShare()
        """Virtual token counters per tenant."""
        self._unfinished: Counter[str] = Counter()
        """Unfinished requests per tenant (the active tenants)."""

    def added(self, group: list[Request]) -> None:
        tenant = group[0].tenant
        if not self._unfinished[tenant]:
            self.fair_share.activate(tenant, +self._unfinished)
        self._unfinished[tenant] += len(group)

    def ended(self, request: Request) -> None:
        self._unfinished[request.tenant] -= 1
        if self._unfinished[request.tenant] <= 0:
            del self._unfinished[request.tenant]
            if not self._unfinished:
                self.fair_share.clear()

    def waiting_order(self, waiting: Iterable[Request]) -> Iterator[Request]:
        return self.fair_share.order(waiting)

    def charge(self, request: Request, tokens: int) -> None:
        self.fair_share.charge(request.tenant, tokens, request.tenant_weight)

    def first_to_start(self, scheduler: Scheduler, preempted: list[Request]) -> list[Request]:
        """The claimants of places moved from over-served tenants, then `_prefill_heads`."""
        claimants = self._reclaim_places(scheduler, preempted)
        return claimants + self._prefill_heads(scheduler, claimants)

    def _reclaim_places(self, scheduler: Scheduler, preempted: list[Request]) -> list[Request]:
        """With a full batch: moves places from over-served running tenants to waiting
        ones, preempting one donor request per move into `preempted`. Returns the
        claimants' head requests."""
        running, max_num_seqs = scheduler.running, scheduler.config.max_num_seqs
        if not len(scheduler.waiting) or len(running) < max_num_seqs:
            return []
        places: Counter[str] = Counter(r.tenant for r in running)
        weights = {r.tenant: r.tenant_weight for r in running}
        queues = tenant_queues(scheduler.waiting)
        for tenant, queue in queues.items():
            weights.setdefault(tenant, queue[0].tenant_weight)
        adapters = scheduler.running_adapters()
        gate = scheduler.slot_gate
        claimants: list[Request] = []
        while len(running) + len(claimants) >= max_num_seqs:
            heads = {tenant: queue[0] for tenant, queue in queues.items() if queue}
            may_start = functools.partial(scheduler.finds_slot, adapters=adapters, gate=gate)
            move = self.fair_share.place_move(places, weights, heads, may_start)
            if move is None:
                break
            claimant, donor = move
            victim = min(
                (r for r in running if r.tenant == donor),
                key=lambda r: (r.num_computed_tokens, -r.arrival_time),
            )
            scheduler.preempt(victim)
            preempted.append(victim)
            places[donor] -= 1
            places[claimant] += 1
            claimants.append(queues[claimant].popleft())
            adapters = scheduler.running_adapters() | _adapter_keys(claimants)
            if claimants[-1] is gate:
                gate = None
        return claimants

    def _prefill_heads(self, scheduler: Scheduler, claimants: list[Request]) -> list[Request]:
        """As many as there are free places: the slot gate if it finds a slot, then the
        head request of each other waiting tenant that has no prompt being computed (no
        running request with prompt tokens left) and no claimant, lowest counter first,
        passing over a head that may not start (`finds_slot`) or whose first chunk's KV
        blocks are not free now (`fits_now`). They start this step ahead of running
        requests' prefill chunks: each tenant gets one prompt under way before another
        tenant's long prompt takes the whole step."""
        running = scheduler.running
        free = scheduler.config.max_num_seqs - len(running) - len(claimants)
        if not len(scheduler.waiting) or free <= 0:
            return []
        adapters = scheduler.running_adapters() | _adapter_keys(claimants)
        gate = scheduler.slot_gate
        if any(r is gate for r in claimants):
            gate = None
        picked: list[Request] = []
        if gate is not None and scheduler.finds_slot(gate, adapters, gate):
            if scheduler.fits_now(gate):
                picked.append(gate)
                gate = None
        busy = {r.tenant for r in running if r.num_uncomputed_tokens > 1}
        busy |= {r.tenant for r in claimants + picked}
        heads: dict[str, Request] = {}
        for request in scheduler.waiting:
            if request.tenant not in busy:
                heads.setdefault(request.tenant, request)
        counter = self.fair_share.counter
        for tenant in sorted(heads, key=lambda t: (counter(t), heads[t].arrival_time)):
            if len(picked) >= free:
                break
            head = heads[tenant]
            may_start = scheduler.finds_slot(head, adapters | _adapter_keys(picked), gate)
            if may_start and scheduler.fits_now(head):
                picked.append(head)
        return picked


def _adapter_keys(requests: Iterable[Request]) -> set[bytes]:
    return {r.adapter_key for r in requests if r.adapter_key is not None}


def policy_for(name: str) -> SchedulingPolicy:
    """The policy object of a `SchedulerConfig.policy` name."""
    return FairSharePolicy() if name == "fair" else FcfsPolicy()
