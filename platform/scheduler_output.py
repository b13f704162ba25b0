"""What the scheduler decides for one step: each scheduled request with the tokens it
computes now (and its drafts), the step's block copies, forks and preemptions."""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.platform.request import Request


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
        """True when this chunk reaches the end of the known tokens (a new token follows);
        never for an embedding request, which generates nothing."""
        req = self.request
        return req.pooling is None and req.num_computed_tokens + self.num_tokens == req.num_tokens


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
