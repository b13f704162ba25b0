"""Turns sampled tokens into RequestOutputs: incremental text, stop strings, n > 1 groups.

One `IncrementalDetokenizer` per request keeps text generation O(new tokens); a request
whose `output_kind` is DELTA gets only what is new in each output (RequestOutput). Each step
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
    DELTA,
    CompletionOutput,
    Request,
    RequestFailure,
    RequestOutput,
)

logger = logging.getLogger(__name__)


@dataclass
class _Sent:
    """How much of one completion a DELTA request's outputs already carried."""

    text: int = 0
    tokens: int = 0
    logprobs: int = 0
    ended: bool = False


@dataclass
class _Group:
    members: list[Request]
    detokenizers: list[IncrementalDetokenizer]
    sent: list[_Sent] | None = None
    """DELTA requests: what each completion's outputs carried so far."""
    prompt_logprobs_sent: bool = False

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
        delta = group[0].sampling_params.output_kind == DELTA
        sent = [_Sent() for _ in group] if delta else None
        self._groups[group[0].group_id] = _Group(group, detokenizers, sent)

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
        if group.sent is None:
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
        else:
            completions = _deltas(group)
        head = group.members[0]
        prompt_logprobs = None
        if head.sampling_params.prompt_logprobs is not None and not group.prompt_logprobs_sent:
            if group.sent is None:
                prompt_logprobs = [None, *head.prompt_logprobs]
            elif finished or any(c.token_ids for c in completions):
                prompt_logprobs = [None, *head.prompt_logprobs]
                group.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=group_id,
            prompt_token_ids=head.prompt_token_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=head.num_cached_prompt_tokens,
            error=next((m.failure for m in group.members if m.failure is not None), None),
            prompt_logprobs=prompt_logprobs,
            embedding=head.embedding,
        )


def _deltas(group: _Group) -> list[CompletionOutput]:
    """A DELTA group's completions that gained something or ended since its previous
    output, each with only what is new (RequestOutput)."""
    assert group.sent is not None
    completions = []
    for member, detokenizer, sent in zip(
        group.members, group.detokenizers, group.sent, strict=True
    ):
        if sent.ended:
            continue
        text = detokenizer.full_text if member.finished else detokenizer.text
        tokens = member.output_token_ids
        if len(text) == sent.text and len(tokens) == sent.tokens and not member.finished:
            continue
        logprobs = None
        if member.sampling_params.logprobs is not None:
            logprobs = member.output_logprobs[sent.logprobs :]
            sent.logprobs += len(logprobs)
        completions.append(
            CompletionOutput(
                index=member.index,
                text=text[sent.text :],
                token_ids=tokens[sent.tokens :],
                finish_reason=member.finish_reason,
                stop_reason=member.stop_reason,
                logprobs=logprobs,
            )
        )
        sent.text, sent.tokens, sent.ended = len(text), len(tokens), member.finished
    return completions
