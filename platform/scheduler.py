"""Iteration-level scheduling policy. Never touches tensors.

Each step the scheduler decides "request -> number of tokens to compute now":
running requests first (decodes, then unfinished prefill chunks, each in admission
order, so a long prompt's chunk never stalls another request's decode), then waiting
requests while the token budget, `max_num_seqs` and free KV blocks allow.
When a running request cannot get a block, the lowest-ranked running request is
preempted: its blocks are freed and it later recomputes prompt + generated tokens.

A request asking for prompt logprobs takes no prefix-cache hit until every prompt
token was scored (cached K/V gives no logits to score them with).

An embedding request (`Request.pooling`) never samples: the step that computes its last
prompt position books its embedding and ends it (platform/pooling.py); one that pools
more than the last position takes no prefix-cache hit, like prompt logprobs.

n > 1 sampling: child 0 of a group computes the prompt; its siblings wait outside the
queues and fork child 0's blocks the step its first token is sampled.

Speculative decoding (platform/spec_decode.py): once the step's known tokens are
placed, decodes of speculating requests get drafts from the proposer, within the
budget left and the free KV blocks (drafts never preempt and never take budget from
another request's tokens); after the step the scheduler books how many were accepted
and returns the blocks that only rejected drafts used.

Who is served first is a policy object's (platform/scheduling_policy.py): the waiting
queue's order under `fcfs` and `priority`; under `fair`, tenant fair share, whose hooks
also start claimants of reclaimed places and tenants' head requests ahead of running
prefill chunks. The scheduler is FCFS plus those hooks.

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

import itertools
from collections.abc import Mapping, Sequence

from loraplex.platform.config import SchedulerConfig
from loraplex.platform.kv_cache_manager import KVCacheManager
from loraplex.platform.pooling import add_pooled, end_pooling
from loraplex.platform.request import Logprob, Request, RequestFailure, RequestStatus
from loraplex.platform.scheduler_output import ScheduledRequest, SchedulerOutput
from loraplex.platform.scheduling_policy import policy_for
from loraplex.platform.spec_decode import NgramProposer, SpecDecodeStats
from loraplex.platform.waiting_queue import WaitingQueue


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
        self.policy = policy_for(config.policy)
        """Who is served first (platform/scheduling_policy.py)."""
        self.slot_gate: Request | None = None
        """The waiting request no other adapter request may start before (module
        docstring), or None."""

    # ---- admission -------------------------------------------------------------
    def add(self, group: list[Request]) -> None:
        """Queues a request group (n children sharing a prompt)."""
        self.policy.added(group)
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
        first = self.policy.first_to_start(self, preempted)
        reclaimed = len(preempted)
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
                self.preempt(victim)
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

        if len(preempted) == reclaimed:  # nothing lost its blocks to a full cache
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
        head = next(self.policy.waiting_order(self.waiting), None)
        if head is not None and head.adapter_key not in self.running_adapters() | {None}:
            self.slot_gate = head

    def finds_slot(self, request: Request, adapters: set[bytes], gate: Request | None) -> bool:
        """Whether `request` may start as far as adapter slots go, `adapters` being the
        ones held: a base-model request always; while `gate` waits, no other request
        with an adapter; else one whose adapter holds a slot or finds a free one."""
        key = request.adapter_key
        if key is None:
            return True
        if gate is not None and request is not gate:
            return False
        return key in adapters or len(adapters) < self.max_loras

    def fits_now(self, request: Request) -> bool:
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
        (the policy's `first_to_start`), then the policy's waiting order."""
        chunked = self.config.enable_chunked_prefill
        adapters = self.running_adapters()
        gate = self.slot_gate
        admitted: set[int] = set()
        leading = {id(request) for request in first}
        order = itertools.chain(
            first, (r for r in self.policy.waiting_order(self.waiting) if id(r) not in leading)
        )
        for request in order:
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            key = request.adapter_key
            if not self.finds_slot(request, adapters, gate):
                if gate is None:
                    gate = request  # for this step: the adapter requests after it wait
                continue
            cached = (
                [] if request.computes_whole_prompt else self.kv_cache.find_cached_prefix(request)
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
                self.policy.charge(request, request.num_tokens - request.num_computed_tokens)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(ScheduledRequest(request, num_new, []))
            budget -= num_new
        self.waiting.remove_all(admitted)
        return budget

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

    def preempt(self, request: Request) -> None:
        self.running.remove(request)
        request.pooled = None  # its prompt is pooled again as it is recomputed
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
        prompt_logprobs: Mapping[str, Sequence[Logprob]] | None = None,
        pooled: Mapping[str, object] | None = None,
    ) -> list[Request]:
        """Books the step's scored prompt positions (`prompt_logprobs` per request id),
        advances computed counts, forks siblings, appends each request's first new
        token and ends the groups whose step `failed` (each with that failure). Returns
        the requests that got a new token or failed this step. Whether a request with a
        new token stops is `check_stop`'s to say (platform/stop.py); the engine then
        calls `finish`.

        `sampled[request id]` is the request's new tokens with their logprobs: one, or
        after a speculating decode the accepted drafts then the bonus token. Their count
        books the verification: the accepted drafts' K/V counts as computed, the blocks
        past the request's tokens go back to the pool (rollback), and the spec-decode
        counters advance. The engine appends the tokens after the first one by one,
        stopping at the first that ends the request.

        `pooled[request id]` is the sum of the hidden states an embedding request's
        chunk pooled; the step that completes its prompt ends it with its embedding (or
        fails it when the embedding is not finite), and it is among those returned."""
        for request_id, logprobs in (prompt_logprobs or {}).items():
            self.requests[request_id].prompt_logprobs.extend(logprobs)
        for request_id, rows in (pooled or {}).items():
            add_pooled(self.requests[request_id], rows)
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
            self.policy.charge(request, len(tokens))
            updated.append(request)
        for request in [s.request for s in output.scheduled if s.request.pooling is not None]:
            if request.request_id in self.requests and end_pooling(request):
                updated.append(request)
                self.finish(request, RequestStatus.FINISHED_STOPPED)
            elif request.failure is not None and request.request_id in self.requests:
                updated.extend(self.fail_group(request.group_id, request.failure))
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
            self.policy.ended(request)
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
