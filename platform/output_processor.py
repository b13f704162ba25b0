"""Turns sampled tokens into RequestOutputs: incremental text, stop strings, n > 1 groups.

One `IncrementalDetokenizer` per request keeps text generation O(new tokens). Each step
the engine first calls `detokenize`, which reports the stop strings found and the
groups whose detokenizing raised, and changes no request; the engine ends those
requests through the scheduler, then calls `outputs`. A group with a failed request
reports the failure as its output's `error`; the other groups are untouched.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from loraplex.platform.detokenizer import IncrementalDetokenizer
from loraplex.platform.request import (
    CompletionOutput,
    Request,
    RequestFailure,
    RequestOutput,
)

logger = logging.getLogger(__name__)


@dataclass
class _Group:
    members: list[Request]
    detokenizers: list[IncrementalDetokenizer]

    @property
    def finished(self) -> bool:
        return all(member.finished for member in self.members)


@dataclass(frozen=True)
class Detokenized:
    """What one step's new text decided."""

    stop_strings: Mapping[str, str]
    """request id -> the stop string its text now contains."""
    failed: Mapping[str, RequestFailure]
    """group id -> why detokenizing one of its requests raised (the group must end)."""


class OutputProcessor:
    def __init__(self, tokenizer: object) -> None:
        self.tokenizer = tokenizer
        self._groups: dict[str, _Group] = {}

    def add(self, group: list[Request]) -> None:
        """Tracks a request group's text, in its adapter's tokenizer where it has its own
        (a resized vocabulary), else the model's."""
        lora = group[0].lora
        tokenizer = lora.tokenizer if lora is not None and lora.tokenizer else self.tokenizer
        detokenizers = [
            IncrementalDetokenizer(tokenizer, r.prompt_token_ids, r.sampling_params) for r in group
        ]
        self._groups[group[0].group_id] = _Group(group, detokenizers)

    def __contains__(self, group_id: str) -> bool:
        return group_id in self._groups

    def detokenize(self, updated: list[Request]) -> Detokenized:
        """Detokenizes the new token of every request in `updated` that has not failed,
        skipping the rest of a group once one of its requests failed to detokenize."""
        stop_strings: dict[str, str] = {}
        failed: dict[str, RequestFailure] = {}
        for request in updated:
            if request.failure is not None or request.group_id in failed:
                continue
            if request.pooling is not None:
                continue  # an embedding: no tokens
            detokenizer = self._groups[request.group_id].detokenizers[request.index]
            try:
                detokenizer.append(request.output_token_ids[-1:])
            except Exception as exc:
                logger.exception("request %s: detokenizing failed", request.request_id)
                failed[request.group_id] = RequestFailure(
                    f"detokenizing the output failed: {exc!r}"
                )
                continue
            if detokenizer.finished_by_stop is not None:
                stop_strings[request.request_id] = detokenizer.finished_by_stop
        return Detokenized(stop_strings, failed)

    def outputs(self, updated: list[Request]) -> list[RequestOutput]:
        """One output per group that `updated` touches, in order of first touch; a
        finished group is forgotten once its output is built."""
        group_ids = dict.fromkeys(request.group_id for request in updated)
        return [self._output(group_id, self._groups[group_id]) for group_id in group_ids]

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
            prompt_logprobs=[None, *head.prompt_logprobs]
            if head.sampling_params.prompt_logprobs is not None
            else None,
            embedding=head.embedding,
        )
