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
    """Collects one request's deltas per choice; emits chunks or the final body."""

    def __init__(self, request_id: str, model: str, chat: bool, n: int) -> None:
        self.request_id = request_id
        self.model = model
        self.chat = chat
        self.created = int(time.time())
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.texts = [""] * n
        self.completion_tokens = [0] * n
        self.finish_reasons: list[str | None] = [None] * n
        self.logprobs: list[list[Logprob]] = [[] for _ in range(n)]
        self._role_sent = [False] * n

    @property
    def object_name(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def add(self, step: StreamStep) -> None:
        self.prompt_tokens = step.prompt_tokens
        self.cached_tokens = step.cached_tokens
        for delta in step.deltas:
            self.texts[delta.index] += delta.text
            self.completion_tokens[delta.index] += delta.num_new_tokens
            self.logprobs[delta.index].extend(delta.logprobs)
            if delta.finish_reason is not None:
                self.finish_reasons[delta.index] = _openai_finish(delta.finish_reason)

    def chunks(self, step: StreamStep) -> list[dict[str, Any]]:
        self.add(step)
        return [self._chunk(delta) for delta in step.deltas]

    def _chunk(self, delta: StreamDelta) -> dict[str, Any]:
        finish = _openai_finish(delta.finish_reason)
        if self.chat:
            content: dict[str, Any] = {"content": delta.text}
            if not self._role_sent[delta.index]:
                content["role"] = "assistant"
                self._role_sent[delta.index] = True
            choice: dict[str, Any] = {"index": delta.index, "delta": content}
            choice["logprobs"] = _chat_logprobs(delta.logprobs) if delta.logprobs else None
        else:
            choice = {"index": delta.index, "text": delta.text}
            choice["logprobs"] = _completion_logprobs(delta.logprobs) if delta.logprobs else None
        choice["finish_reason"] = finish
        return self._envelope(
            f"{self.object_name}.chunk" if self.chat else self.object_name, [choice]
        )

    def usage(self) -> dict[str, Any]:
        completion = sum(self.completion_tokens)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def usage_chunk(self) -> dict[str, Any]:
        name = "chat.completion.chunk" if self.chat else "text_completion"
        chunk = self._envelope(name, [])
        chunk["usage"] = self.usage()
        return chunk

    def final(self) -> dict[str, Any]:
        choices = []
        for index, text in enumerate(self.texts):
            logprobs = self.logprobs[index]
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
            choice["finish_reason"] = self.finish_reasons[index]
            choices.append(choice)
        body = self._envelope(self.object_name, choices)
        body["usage"] = self.usage()
        return body

    def _envelope(self, name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }


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
