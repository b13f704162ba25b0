"""Iteration-level scheduling policy. Never touches tensors.

Each step the scheduler decides "request -> number of tokens to compute now":
running requests first (decodes, then unfinished prefill chunks, each in admission
order, so a long prompt's chunk never stalls another request's decode), then waiting
requests while the token budget, `max_num_seqs` and free KV blocks allow.
When a running request cannot get a block, the lowest-ranked running request is
preempted: its blocks are freed and it later recomputes prompt + generated tokens.

A request asking for prompt logprobs takes no prefix-cache hit until every prompt
token was scored (cached K/V gives no logits to score them with).

n > 1 sampling: child 0 of a group computes the prompt; its siblings wait outside the
queues and fork child 0's blocks the step its first token is sampled.

Speculative decoding (platform/spec_decode.py): once the step's known tokens are
placed, decodes of speculating requests get drafts from the proposer, within the
budget left and the free KV blocks (drafts never preempt and never take budget from
another request's tokens); after the step the scheduler books how many were accepted
and returns the blocks that only rejected drafts used.

Fair share (`policy: fair`, platform/fair_share.py): waiting requests are admitted
from the tenant with the fewest weighted tokens served (FCFS within a tenant); the
scheduler charges each tenant its computed prompt tokens at admission and its sampled
tokens after each step. When the batch is full, a waiting tenant may take a place from
the running tenant holding the most places per weight, as long as it then still holds
no more places per weight than that tenant (max-min fair places: a move is never
undone by the reverse move, so places do not churn). The place goes to the claimant's
head request this step; the donor's request with the least computed work is preempted
(its full blocks stay in the prefix cache for its recompute). A waiting tenant with no
prompt under way has its head request start in a free place first, and the step keeps
its prompt's tokens (and the claimants') from running requests' prefill chunks. A
light tenant's request thus starts at the next step, neither after a heavy tenant's
request ends nor after its long prompt.

LoRA: at most `max_loras` distinct adapters run at once (one device slot each). When
the request the policy serves next (the queue's head; under `fair`, the head of the
lowest-counter tenant) has an adapter that holds no slot, it becomes the slot gate
(one at a time) until it starts. Meanwhile no other request with an adapter starts,
even on a running adapter (base-model requests still do), and the gate starts first
once its adapter finds a slot and it finds a place (under `fair`: the first free
place, ahead of the other tenants' heads, or one its tenant reclaims). Bound, with no
slot ever taken from a running request: the adapter requests running when it became
the gate are the only ones left on the slots, so it has one once they end (a token per
step once their prompt is computed, while the budget and KV blocks allow: within their
longest remaining `max_tokens`); then a place at the latest when one more running
request ends (unless base-model requests ranked before it, as by priority, take it).
Within one step, a request that finds no slot also holds back the adapter requests
after it in the admission order; under `fair`, a tenant head that finds no slot is
passed over for the next tenant's in the free places.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from loraplex.platform.config import SchedulerConfig
from loraplex.platform.fair_share import FairShare, tenant_queues
from loraplex.platform.kv_cache_manager import KVCacheManager
from loraplex.platform.request import Request, RequestFailure, RequestStatus
from loraplex.platform.spec_decode import NgramProposer, SpecDecodeStats


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int
    """Known tokens (prompt or generated) this step computes."""
    block_ids: list[int]
    draft_token_ids: list[int] = field(default_factory=list)
    """Speculative tokens computed after the newest known token (platform/spec_decode.py);
    only on a decode (num_tokens == 1)."""

    @property
    def num_query_tokens(self) -> int:
        """Tokens this request puts through the model this step: known ones, then drafts."""
        return self.num_tokens + len(self.draft_token_ids)

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the known tokens (a new token follows)."""
        req = self.request
        return req.num_computed_tokens + self.num_tokens == req.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    block_copies: list[tuple[int, int]]
    forks: dict[str, list[Request]] = field(default_factory=dict)
    """request id of child 0 -> siblings that sample from its logits this step."""
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Query tokens of the step, drafts included (what the token budget bounds)."""
        return sum(s.num_query_tokens for s in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


class WaitingQueue:
    """Requests ordered by (priority, arrival); FCFS when priorities are equal. A sorted
    list: arrivals append at the tail, admission iterates from the head."""

    def __init__(self, use_priority: bool) -> None:
        self._use_priority = use_priority
        self._entries: list[tuple[int, float, int, Request]] = []
        self._order = itertools.count()

    def push(self, request: Request) -> None:
        priority = request.priority if self._use_priority else 0
        entry = (priority, request.arrival_time, next(self._order), request)
        bisect.insort(self._entries, entry, key=lambda e: e[:3])

    def remove(self, request: Request) -> None:
        self.remove_all({id(request)})

    def remove_all(self, request_ids: set[int]) -> None:
        """Drops the requests whose `id()` is in `request_ids`."""
        self._entries = [e for e in self._entries if id(e[3]) not in request_ids]

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self):
        return iter([entry[3] for entry in self._entries])


def _adapter_keys(requests: Sequence[Request]) -> set[bytes]:
    return {r.adapter_key for r in requests if r.adapter_key is not None}


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        max_loras: int = 0,
        proposer: NgramProposer | None = None,
        spec_stats: SpecDecodeStats | None = None,
    ) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.max_loras = max_loras
        self.proposer = proposer
        """Drafts for speculating decodes (None: speculative decoding is off)."""
        if spec_stats is None:
            spec_stats = SpecDecodeStats(proposer.num_speculative_tokens if proposer else 0)
        self.spec_stats = spec_stats
        """Acceptance counters the scheduler advances as it books verifications."""
        self.waiting = WaitingQueue(config.policy == "priority")
        self.running: list[Request] = []
        self.fork_waiting: dict[str, list[Request]] = {}
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.fair_share = FairShare() if config.policy == "fair" else None
        """Virtual token counters per tenant (None unless the policy is `fair`)."""
        self._tenant_requests: Counter[str] = Counter()
        """Unfinished requests per tenant (the active tenants)."""
        self.slot_gate: Request | None = None
        """The waiting request no other adapter request may start before (module
        docstring), or None."""

    # ---- admission -------------------------------------------------------------
    def add(self, group: list[Request]) -> None:
        """Queues a request group (n children sharing a prompt)."""
        tenant = group[0].tenant
        if self.fair_share is not None and not self._tenant_requests[tenant]:
            self.fair_share.activate(tenant, +self._tenant_requests)
        self._tenant_requests[tenant] += len(group)
        for request in group:
            self.requests[request.request_id] = request
        self.waiting.push(group[0])
        if len(group) > 1:
            for sibling in group[1:]:
                sibling.status = RequestStatus.WAITING_FOR_FORK
            self.fork_waiting[group[0].request_id] = group[1:]

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def _rank(self, request: Request) -> tuple[int, float]:
        priority = request.priority if self.config.policy == "priority" else 0
        return (priority, request.arrival_time)

    # ---- one step ---------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        chunked = self.config.enable_chunked_prefill

        self._open_slot_gate()
        claimants = self._reclaim_places(preempted)
        first = claimants + self._prefill_heads(claimants)
        reserve = min(budget, sum(r.num_uncomputed_tokens for r in first))
        self.running.sort(key=self._rank)
        for request in sorted(self.running, key=lambda r: r.num_uncomputed_tokens > 1):
            if request.status is not RequestStatus.RUNNING:
                continue
            num_new = request.num_uncomputed_tokens
            room = budget if num_new <= 1 else budget - reserve
            if chunked:
                num_new = min(num_new, room)
            if num_new <= 0 or num_new > room:
                continue
            while not self.kv_cache.allocate(request, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                # A lower-ranked decode scheduled earlier in this loop can be the victim
                # of a prefill chunk after it: it leaves the step and gives back its tokens.
                for index, item in enumerate(scheduled):
                    if item.request is victim:
                        budget += scheduled.pop(index).num_tokens
                        break
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue
            scheduled.append(ScheduledRequest(request, num_new, []))
            budget -= num_new

        if len(preempted) == len(claimants):  # nothing lost its blocks to a full cache
            budget = self._admit_waiting(scheduled, budget, first)
        if self.proposer is not None:
            self._add_drafts(scheduled, budget)

        for item in scheduled:
            item.block_ids = self.kv_cache.block_ids(item.request.request_id)
        forks = {
            item.request.request_id: self.fork_waiting[item.request.request_id]
            for item in scheduled
            if item.samples and item.request.request_id in self.fork_waiting
        }
        return SchedulerOutput(
            scheduled=scheduled,
            block_copies=self.kv_cache.take_pending_copies(),
            forks=forks,
            preempted=preempted,
        )

    def running_adapters(self) -> set[bytes]:
        """Identity keys of the adapters running requests use (each holds a slot)."""
        return {r.adapter_key for r in self.running if r.adapter_key is not None}

    def _open_slot_gate(self) -> None:
        """Makes the head of the waiting order the slot gate when no gate waits and its
        adapter holds no slot (it may find a free one at once)."""
        if self.slot_gate is not None:
            return
        head = next(self._waiting_order(), None)
        if head is not None and head.adapter_key not in self.running_adapters() | {None}:
            self.slot_gate = head

    def _finds_slot(self, request: Request, adapters: set[bytes], gate: Request | None) -> bool:
        """Whether `request` may start as far as adapter slots go, `adapters` being the
        ones held: a base-model request always; while `gate` waits, no other request
        with an adapter; else one whose adapter holds a slot or finds a free one."""
        key = request.adapter_key
        if key is None:
            return True
        if gate is not None and request is not gate:
            return False
        return key in adapters or len(adapters) < self.max_loras

    def _reclaim_places(self, preempted: list[Request]) -> list[Request]:
        """Under `fair` with a full batch, before the step is filled: moves places from
        over-served running tenants to waiting ones (module docstring), preempting one
        donor request per move into `preempted`. Returns the claimants' head requests,
        which admission takes first."""
        if (
            self.fair_share is None
            or not len(self.waiting)
            or len(self.running) < self.config.max_num_seqs
        ):
            return []
        places: Counter[str] = Counter(r.tenant for r in self.running)
        weights = {r.tenant: r.tenant_weight for r in self.running}
        queues = tenant_queues(self.waiting)
        for tenant, queue in queues.items():
            weights.setdefault(tenant, queue[0].tenant_weight)
        adapters = self.running_adapters()
        gate = self.slot_gate
        claimants: list[Request] = []
        while len(self.running) + len(claimants) >= self.config.max_num_seqs:
            heads = {tenant: queue[0] for tenant, queue in queues.items() if queue}
            may_start = functools.partial(self._finds_slot, adapters=adapters, gate=gate)
            move = self.fair_share.place_move(places, weights, heads, may_start)
            if move is None:
                break
            claimant, donor = move
            victim = min(
                (r for r in self.running if r.tenant == donor),
                key=lambda r: (r.num_computed_tokens, -r.arrival_time),
            )
            self._preempt(victim)
            preempted.append(victim)
            places[donor] -= 1
            places[claimant] += 1
            claimants.append(queues[claimant].popleft())
            adapters = self.running_adapters() | _adapter_keys(claimants)
            if claimants[-1] is gate:
                gate = None
        return claimants

    def _prefill_heads(self, claimants: list[Request]) -> list[Request]:
        """Under `fair`, as many as there are free places: the slot gate if it finds a
        slot, then the head request of each other waiting tenant that has no prompt
        being computed (no running request with prompt tokens left) and no claimant,
        lowest counter first, passing over a head that may not start (`_finds_slot`)
        or whose first chunk's KV blocks are not free now (`_fits_now`).
        They start this step ahead of running requests' prefill chunks: each tenant
        gets one prompt under way before another tenant's long prompt takes the whole
        step."""
        free = self.config.max_num_seqs - len(self.running) - len(claimants)
        if self.fair_share is None or not len(self.waiting) or free <= 0:
            return []
        adapters = self.running_adapters() | _adapter_keys(claimants)
        gate = None if any(r is self.slot_gate for r in claimants) else self.slot_gate
        picked: list[Request] = []
        if gate is not None and self._finds_slot(gate, adapters, gate) and self._fits_now(gate):
            picked.append(gate)
            gate = None
        busy = {r.tenant for r in self.running if r.num_uncomputed_tokens > 1}
        busy |= {r.tenant for r in claimants + picked}
        heads: dict[str, Request] = {}
        for request in self.waiting:
            if request.tenant not in busy:
                heads.setdefault(request.tenant, request)
        for tenant in sorted(
            heads, key=lambda t: (self.fair_share.counter(t), heads[t].arrival_time)
        ):
            if len(picked) >= free:
                break
            head = heads[tenant]
            if self._finds_slot(head, adapters | _adapter_keys(picked), gate) and self._fits_now(
                head
            ):
                picked.append(head)
        return picked

    def _fits_now(self, request: Request) -> bool:
        """Whether the KV cache has the blocks for a waiting request's first chunk now. A
        head that does not fit is not given the step's budget ahead of running prefill
        chunks: those may be what must finish (and free their blocks) before it fits."""
        cached = self.kv_cache.find_cached_prefix(request, count=False)
        num_new = request.num_tokens - len(cached) * self.kv_cache.block_size
        if self.config.enable_chunked_prefill:
            num_new = min(num_new, self.config.max_num_batched_tokens)
        return self.kv_cache.can_allocate(request, num_new, cached)

    def _admit_waiting(
        self, scheduled: list[ScheduledRequest], budget: int, first: Sequence[Request] = ()
    ) -> int:
        """Admits waiting requests while places, budget and KV blocks allow: `first`
        (claimants of reclaimed places, then `_prefill_heads`), then the queue's order."""
        chunked = self.config.enable_chunked_prefill
        adapters = self.running_adapters()
        gate = self.slot_gate
        admitted: set[int] = set()
        leading = {id(request) for request in first}
        order = itertools.chain(first, (r for r in self._waiting_order() if id(r) not in leading))
        for request in order:
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            key = request.adapter_key
            if not self._finds_slot(request, adapters, gate):
                if gate is None:
                    gate = request  # for this step: the adapter requests after it wait
                continue
            cached = (
                [] if request.needs_prompt_logprobs else self.kv_cache.find_cached_prefix(request)
            )
            num_new = request.num_tokens - len(cached) * self.kv_cache.block_size
            if chunked:
                num_new = min(num_new, budget)
            elif num_new > budget:
                break
            if not self.kv_cache.allocate(request, num_new, cached):
                break
            admitted.add(id(request))
            if request is self.slot_gate:
                self.slot_gate = gate = None
            if key is not None:
                adapters.add(key)
            request.num_computed_tokens = len(cached) * self.kv_cache.block_size
            if request.num_preemptions == 0:
                request.num_cached_prompt_tokens = request.num_computed_tokens
                self._charge(request, request.num_tokens - request.num_computed_tokens)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(ScheduledRequest(request, num_new, []))
            budget -= num_new
        self.waiting.remove_all(admitted)
        return budget

    def _waiting_order(self) -> Iterator[Request]:
        """Waiting requests in admission order: the queue's, or under `fair` the
        lowest-counter tenant's head each time (`FairShare.order`)."""
        if self.fair_share is None:
            return iter(self.waiting)
        return self.fair_share.order(self.waiting)

    def _charge(self, request: Request, tokens: int) -> None:
        if self.fair_share is not None:
            self.fair_share.charge(request.tenant, tokens, request.tenant_weight)

    def _add_drafts(self, scheduled: list[ScheduledRequest], budget: int) -> None:
        """Gives decodes of speculating requests their drafts, last, from what the step
        left: token budget and free KV blocks (never a preemption); a decode that cannot
        have its drafts' slots runs without them."""
        for item in scheduled:
            if budget <= 0:
                return
            if item.num_tokens != 1 or not item.samples:
                continue
            drafts = self.proposer.propose(item.request, budget)
            if drafts and self.kv_cache.allocate_draft_slots(item.request, len(drafts)):
                item.draft_token_ids = drafts
                budget -= len(drafts)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache.free(request)
        self.kv_cache.forget_hashes(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(request)

    # ---- after the model ran ---------------------------------------------------------
    def update(
        self,
        output: SchedulerOutput,
        sampled: Mapping[str, Sequence[tuple[int, object]]],
        failed: dict[str, RequestFailure] | None = None,
    ) -> list[Request]:
        """Advances computed counts, forks siblings, appends each request's first new
        token and ends the groups whose step `failed` (each with that failure). Returns
        the requests that got a new token or failed this step. Whether a request with a
        new token stops is `check_stop`'s to say (platform/stop.py); the engine then
        calls `finish`.

        `sampled[request id]` is the request's new tokens with their logprobs: one, or
        after a speculating decode the accepted drafts then the bonus token. Their count
        books the verification: the accepted drafts' K/V counts as computed, the blocks
        past the request's tokens go back to the pool (rollback), and the spec-decode
        counters advance. The engine appends the tokens after the first one by one,
        stopping at the first that ends the request."""
        for item in output.scheduled:
            item.request.num_computed_tokens += item.num_tokens
            if item.draft_token_ids:
                self._book_verification(item, sampled.get(item.request.request_id))
        for parent_id, siblings in output.forks.items():
            parent = self.requests[parent_id]
            del self.fork_waiting[parent_id]
            for sibling in siblings:
                self.kv_cache.fork(parent, sibling)
                sibling.num_computed_tokens = parent.num_computed_tokens
                sibling.status = RequestStatus.RUNNING
                self.running.append(sibling)
        updated = []
        for request_id, failure in (failed or {}).items():
            request = self.requests.get(request_id)
            if request is not None:
                updated.extend(self.fail_group(request.group_id, failure))
        for request_id, tokens in sampled.items():
            request = self.requests.get(request_id)
            if request is None:
                continue  # its group failed this step
            request.append_output_token(*tokens[0])
            self._charge(request, len(tokens))
            updated.append(request)
        return updated

    def _book_verification(
        self, item: ScheduledRequest, tokens: Sequence[tuple[int, object]] | None
    ) -> None:
        request = item.request
        if tokens is None:
            return  # the request failed this step; it ends and frees its blocks
        accepted = len(tokens) - 1
        self.spec_stats.observe(len(item.draft_token_ids), accepted)
        self.proposer.observe(request.request_id, accepted)
        request.num_computed_tokens += accepted
        self.kv_cache.trim(request, request.num_computed_tokens + 1)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Ends a request (stop, length, abort or error) and frees its blocks at once;
        an errored request's blocks also leave the prefix cache. Siblings still waiting
        to fork from it end with it."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        if request is self.slot_gate:
            self.slot_gate = None
        self.kv_cache.free(request, uncache=status is RequestStatus.FINISHED_ERROR)
        if self.requests.pop(request.request_id, None) is not None:
            self._tenant_requests[request.tenant] -= 1
            if self._tenant_requests[request.tenant] <= 0:
                del self._tenant_requests[request.tenant]
                if self.fair_share is not None and not self._tenant_requests:
                    self.fair_share.clear()
        if self.proposer is not None:
            self.proposer.forget(request.request_id)
        for sibling in self.fork_waiting.pop(request.request_id, ()):
            self.finish(sibling, status)

    def fail_group(self, group_id: str, failure: RequestFailure) -> list[Request]:
        """Ends every unfinished request of a group with `failure`; returns them."""
        members = [r for r in self.requests.values() if r.group_id == group_id]
        for request in members:
            request.failure = failure
        for request in members:
            if request.request_id in self.requests:
                self.finish(request, RequestStatus.FINISHED_ERROR)
        return members

    def abandon(self, output: SchedulerOutput) -> None:
        """Undoes what a step that never ran published: the prefix-cache entries of the
        blocks its tokens were to fill (their K/V was never written)."""
        for item in output.scheduled:
            self.kv_cache.unpublish_uncomputed(item.request)
            if item.draft_token_ids:
                self.kv_cache.trim(item.request, item.request.num_tokens)

    def abort_group(self, group_id: str) -> list[Request]:
        """Aborts every unfinished request of a group; returns them."""
        members = [r for r in self.requests.values() if r.group_id == group_id]
        for request in members:
            if request.request_id in self.requests:
                self.finish(request, RequestStatus.FINISHED_ABORTED)
        return members
