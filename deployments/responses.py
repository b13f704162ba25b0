"""Builds OpenAI completion / chat.completion bodies and stream chunks from StreamSteps."""

from __future__ import annotations

import json
import time
from typing import Any

from loraplex.deployments.model_server import StreamDelta, StreamStep
from loraplex.deployments.tool_calls import ToolCallChunk, ToolCalling, ToolCallParser
from loraplex.platform.request import Logprob


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class ChoiceAccumulator:
    """Collects one prompt's deltas per choice; emits chunks or its choices. A request
    with a batch of prompts has one per prompt, each numbering its choices from
    `first_index` (prompt i of n-choice requests: i * n). A chat request with tools
    reads each choice's text through a tool-call parser (deployments/tool_calls.py),
    made when the first step says the model's tool-call format."""

    def __init__(
        self,
        request_id: str,
        model: str,
        chat: bool,
        n: int,
        first_index: int = 0,
        tools: ToolCalling | None = None,
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.chat = chat
        self.first_index = first_index
        self.tools = tools
        self.parsers: list[ToolCallParser | None] = [None] * n
        self._parsers_made = False
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

    def _take(self, step: StreamStep) -> list[tuple[str, list[ToolCallChunk]]]:
        """Books a step; returns each delta's text as the client sees it (a completion's
        first text led by the echoed prompt; with tools, the content part of it) and
        the tool-call chunks it completed."""
        self.prompt_tokens = step.prompt_tokens
        self.cached_tokens = step.cached_tokens
        if step.echo_text is not None:
            self._echo = step.echo_text
        if self.tools is not None and not self._parsers_made:
            # The first step says the model's tool-call format; each choice gets a parser.
            self.parsers = [self.tools.parser(step.tool_call_format) for _ in self.parsers]
            self._parsers_made = True
        released = []
        for delta in step.deltas:
            i = delta.index
            text = delta.text
            if not self._started[i]:
                text = self._echo + text
                self._started[i] = True
            calls: list[ToolCallChunk] = []
            parser = self.parsers[i]
            finish = _openai_finish(delta.finish_reason)
            if parser is not None:
                text, calls = parser.feed(text)
                if finish is not None:
                    more_text, more_calls = parser.finish()
                    text, calls = text + more_text, calls + more_calls
                    if parser.calls and parser.finish_as_tool_calls and finish == "stop":
                        finish = "tool_calls"
            released.append((text, calls))
            self.texts[i] += text
            self.completion_tokens[i] += delta.num_new_tokens
            self.logprobs[i].extend(delta.logprobs)
            if finish is not None:
                self.finish_reasons[i] = finish
        return released

    def chunks(self, step: StreamStep) -> list[dict[str, Any]]:
        first = [not self._started[delta.index] for delta in step.deltas]
        released = self._take(step)
        chunks = []
        for delta, (text, calls), is_first in zip(step.deltas, released, first, strict=True):
            quiet = not (text or calls or is_first or delta.logprobs or delta.finish_reason)
            if quiet and self.parsers[delta.index] is not None:
                continue  # a parser holding text back: nothing to tell yet
            chunks.append(self._chunk(delta, text, calls, is_first))
        return chunks

    def _chunk(
        self, delta: StreamDelta, text: str, calls: list[ToolCallChunk], first: bool
    ) -> dict[str, Any]:
        finish = self.finish_reasons[delta.index] if delta.finish_reason else None
        index = self.first_index + delta.index
        if self.chat:
            content: dict[str, Any] = {"content": text}
            if calls:
                content = {"content": text or None, "tool_calls": [c.as_delta() for c in calls]}
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
                    "message": self._message(offset, text),
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

    def _message(self, offset: int, text: str) -> dict[str, Any]:
        parser = self.parsers[offset]
        calls = parser.calls if parser is not None else []
        if not calls:
            return {"role": "assistant", "content": text}
        return {
            "role": "assistant",
            "content": text or None,
            "tool_calls": [call.as_message_part() for call in calls],
        }

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
