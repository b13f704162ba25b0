"""Builds OpenAI completion / chat.completion bodies and stream chunks from StreamSteps."""

from __future__ import annotations

import json
import time
from typing import Any

from loraplex.deployments.model_server import StreamDelta, StreamStep
from loraplex.platform.request import Logprob


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class ChoiceAccumulator:
    """Collects one prompt's deltas per choice; emits chunks or its choices. A request
    with a batch of prompts has one per prompt, each numbering its choices from
    `first_index` (prompt i of n-choice requests: i * n)."""

    def __init__(
        self, request_id: str, model: str, chat: bool, n: int, first_index: int = 0
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.chat = chat
        self.first_index = first_index
        self.created = int(time.time())
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.texts = [""] * n
        self.completion_tokens = [0] * n
        self.finish_reasons: list[str | None] = [None] * n
        self.logprobs: list[list[Logprob]] = [[] for _ in range(n)]
        self._started = [False] * n
        self._echo = ""

    @property
    def object_name(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def add(self, step: StreamStep) -> None:
        self._take(step)

    def _take(self, step: StreamStep) -> list[str]:
        """Books a step; returns each delta's text as the client sees it (a completion's
        first text led by the echoed prompt)."""
        self.prompt_tokens = step.prompt_tokens
        self.cached_tokens = step.cached_tokens
        if step.echo_text is not None:
            self._echo = step.echo_text
        texts = []
        for delta in step.deltas:
            text = delta.text
            if not self._started[delta.index]:
                text = self._echo + text
                self._started[delta.index] = True
            texts.append(text)
            self.texts[delta.index] += text
            self.completion_tokens[delta.index] += delta.num_new_tokens
            self.logprobs[delta.index].extend(delta.logprobs)
            if delta.finish_reason is not None:
                self.finish_reasons[delta.index] = _openai_finish(delta.finish_reason)
        return texts

    def chunks(self, step: StreamStep) -> list[dict[str, Any]]:
        first = [not self._started[delta.index] for delta in step.deltas]
        texts = self._take(step)
        return [
            self._chunk(delta, text, is_first)
            for delta, text, is_first in zip(step.deltas, texts, first, strict=True)
        ]

    def _chunk(self, delta: StreamDelta, text: str, first: bool) -> dict[str, Any]:
        finish = _openai_finish(delta.finish_reason)
        index = self.first_index + delta.index
        if self.chat:
            content: dict[str, Any] = {"content": text}
            if first:
                content["role"] = "assistant"
            choice: dict[str, Any] = {"index": index, "delta": content}
            choice["logprobs"] = _chat_logprobs(delta.logprobs) if delta.logprobs else None
        else:
            choice = {"index": index, "text": text}
            choice["logprobs"] = _completion_logprobs(delta.logprobs) if delta.logprobs else None
        choice["finish_reason"] = finish
        return self.envelope(
            f"{self.object_name}.chunk" if self.chat else self.object_name, [choice]
        )

    def choices(self) -> list[dict[str, Any]]:
        choices = []
        for offset, text in enumerate(self.texts):
            logprobs = self.logprobs[offset]
            index = self.first_index + offset
            if self.chat:
                choice = {
                    "index": index,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": _chat_logprobs(logprobs) if logprobs else None,
                }
            else:
                choice = {
                    "index": index,
                    "text": text,
                    "logprobs": _completion_logprobs(logprobs) if logprobs else None,
                }
            choice["finish_reason"] = self.finish_reasons[offset]
            choices.append(choice)
        return choices

    def envelope(self, name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }


def usage(accumulators: list[ChoiceAccumulator]) -> dict[str, Any]:
    prompt = sum(a.prompt_tokens for a in accumulators)
    completion = sum(sum(a.completion_tokens) for a in accumulators)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(a.cached_tokens for a in accumulators)},
    }


def usage_chunk(accumulators: list[ChoiceAccumulator]) -> dict[str, Any]:
    """The last stream event with `stream_options.include_usage`: no choices, the usage
    of every prompt of the request."""
    head = accumulators[0]
    chunk = head.envelope("chat.completion.chunk" if head.chat else "text_completion", [])
    chunk["usage"] = usage(accumulators)
    return chunk


def batch_body(accumulators: list[ChoiceAccumulator]) -> dict[str, Any]:
    """The response body of a request: every prompt's choices, in index order, and the
    usage summed over them."""
    head = accumulators[0]
    choices = [choice for a in accumulators for choice in a.choices()]
    body = head.envelope(head.object_name, choices)
    body["usage"] = usage(accumulators)
    return body


def _openai_finish(reason: str | None) -> str | None:
    return "stop" if reason == "abort" else reason


def _completion_logprobs(logprobs: list[Logprob]) -> dict[str, Any]:
    return {
        "token_ids": [lp.token_id for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{str(t): v for t, v in lp.top.items()} for lp in logprobs],
    }


def _chat_logprobs(logprobs: list[Logprob]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": str(lp.token_id),
                "logprob": lp.logprob,
                "top_logprobs": [{"token": str(t), "logprob": v} for t, v in lp.top.items()],
            }
            for lp in logprobs
        ]
    }
