"""Turns sampled tokens into RequestOutputs: incremental text, stop strings, n > 1 groups.

One `IncrementalDetokenizer` per request keeps text generation O(new tokens). A stop
string ends the request through the scheduler (which frees its blocks at once). A
request that failed this step (or whose detokenizing raises) ends its group with the
failure as the output's `error`; the other groups are untouched.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from loraplex.platform.detokenizer import IncrementalDetokenizer
from loraplex.platform.request import (
    CompletionOutput,
    Request,
    RequestFailure,
    RequestOutput,
    RequestStatus,
)
from loraplex.platform.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass
class _Group:
    members: list[Request]
    detokenizers: list[IncrementalDetokenizer]

    @property
    def finished(self) -> bool:
        return all(member.finished for member in self.members)


class OutputProcessor:
    def __init__(self, tokenizer: object, scheduler: Scheduler) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self._groups: dict[str, _Group] = {}

    def add(self, group: list[Request]) -> None:
        detokenizers = [
            IncrementalDetokenizer(self.tokenizer, r.prompt_token_ids, r.sampling_params)
            for r in group
        ]
        self._groups[group[0].group_id] = _Group(group, detokenizers)

    def __contains__(self, group_id: str) -> bool:
        return group_id in self._groups

    def process(self, updated: list[Request]) -> list[RequestOutput]:
        """Detokenizes this step's new tokens and returns one output per touched group."""
        touched: dict[str, _Group] = {}
        for request in updated:
            group = self._groups[request.group_id]
            touched[request.group_id] = group
            if request.failure is not None:
                continue
            try:
                self._append(request, group.detokenizers[request.index])
            except Exception as exc:
                logger.exception("request %s: detokenizing failed", request.request_id)
                failure = RequestFailure(f"detokenizing the output failed: {exc!r}")
                self.scheduler.fail_group(request.group_id, failure)
        return [self._output(group_id, group) for group_id, group in touched.items()]

    def _append(self, request: Request, detokenizer: IncrementalDetokenizer) -> None:
        detokenizer.append(request.output_token_ids[-1:])
        if detokenizer.finished_by_stop is not None and not request.finished:
            request.stop_reason = detokenizer.finished_by_stop
            self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
        elif detokenizer.finished_by_stop is not None:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = detokenizer.finished_by_stop

    def abort(self, group_id: str) -> RequestOutput | None:
        group = self._groups.get(group_id)
        return self._output(group_id, group) if group is not None else None

    def _output(self, group_id: str, group: _Group) -> RequestOutput:
        finished = group.finished
        if finished:
            del self._groups[group_id]
        completions = [
            CompletionOutput(
                index=member.index,
                text=detokenizer.full_text if member.finished else detokenizer.text,
                token_ids=list(member.output_token_ids),
                finish_reason=member.finish_reason,
                stop_reason=member.stop_reason,
                logprobs=list(member.output_logprobs)
                if member.sampling_params.logprobs is not None
                else None,
            )
            for member, detokenizer in zip(group.members, group.detokenizers, strict=True)
        ]
        head = group.members[0]
        return RequestOutput(
            request_id=group_id,
            prompt_token_ids=head.prompt_token_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=head.num_cached_prompt_tokens,
            error=next((m.failure for m in group.members if m.failure is not None), None),
        )
