"""Builds OpenAI completion / chat.completion bodies and stream chunks from StreamSteps,
and embedding lists."""

from __future__ import annotations

import base64
import json
import struct
import time
from typing import Any

from loraplex.deployments.logprobs import (
    TokenLogprob,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs,
    text_offsets,
)
from loraplex.deployments.protocol import Embedding, EmbeddingList, EmbeddingUsage
from loraplex.deployments.tool_calls import ToolCallChunk, ToolCalling, ToolCallParser
from loraplex.deployments.wire import StreamDelta, StreamStep


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class ChoiceAccumulator:
    """Collects one prompt's deltas per choice; emits chunks or its choices. A request
    with a batch of prompts has one per prompt, each numbering its choices from
    `first_index` (prompt i of n-choice requests: i * n). A chat request with tools
    reads each choice's text through a tool-call parser (deployments/tool_calls.py),
    made when the first step says the model's tool-call format.

    Logprobs: each choice's entries with where their text starts in the choice's text;
    a completion with `echo` and `logprobs` (`echo_logprobs`) leads each choice's with
    the prompt's. With prompt logprobs, a completion's choices carry vLLM's
    `prompt_logprobs`, and a chat body carries them at its top level."""

    def __init__(
        self,
        request_id: str,
        model: str,
        chat: bool,
        n: int,
        first_index: int = 0,
        tools: ToolCalling | None = None,
        echo_logprobs: bool = False,
    ) -> None:
        self.request_id = request_id
        self.echo_logprobs = echo_logprobs
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
        self.logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]
        self.offsets: list[list[int]] = [[] for _ in range(n)]
        self.prompt_logprobs: list[TokenLogprob] | None = None
        self._started = [False] * n
        self._next_offset = [0] * n
        self._echo = ""

    @property
    def object_name(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def add(self, step: StreamStep) -> None:
        self._take(step)

    def _take(self, step: StreamStep) -> list[tuple[str, list[ToolCallChunk], int]]:
        """Books a step; returns each delta's text as the client sees it (a completion's
        first text led by the echoed prompt; with tools, the content part of it), the
        tool-call chunks it completed and how many logprob entries it added."""
        self.prompt_tokens = step.prompt_tokens
        self.cached_tokens = step.cached_tokens
        if step.echo_text is not None:
            self._echo = step.echo_text
        if step.prompt_logprobs is not None:
            self.prompt_logprobs = step.prompt_logprobs
        if self.tools is not None and not self._parsers_made:
            # The first step says the model's tool-call format; each choice gets a parser.
            self.parsers = [self.tools.parser(step.tool_call_format) for _ in self.parsers]
            self._parsers_made = True
        released = []
        for delta in step.deltas:
            i = delta.index
            text = delta.text
            added = len(self.logprobs[i])
            if not self._started[i]:
                text = self._echo + text
                self._started[i] = True
                if self.echo_logprobs and self.prompt_logprobs is not None:
                    self._book_logprobs(i, self.prompt_logprobs, 0)
                self._next_offset[i] = len(self._echo)
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
            self._book_logprobs(i, delta.logprobs, self._next_offset[i])
            released.append((text, calls, len(self.logprobs[i]) - added))
            self.texts[i] += text
            self.completion_tokens[i] += delta.num_new_tokens
            if finish is not None:
                self.finish_reasons[i] = finish
        return released

    def _book_logprobs(self, i: int, entries: list[TokenLogprob], first_offset: int) -> None:
        offsets = text_offsets(entries, first_offset)
        self.logprobs[i].extend(entries)
        self.offsets[i].extend(offsets)
        if offsets:
            self._next_offset[i] = offsets[-1] + len(entries[-1].token)

    def _logprobs_body(self, i: int, count: int | None = None) -> dict[str, Any] | None:
        """Choice i's logprobs in the response's shape: all, or the last `count`."""
        entries = self.logprobs[i]
        start = 0 if count is None else len(entries) - count
        if start >= len(entries):
            return None
        if self.chat:
            return chat_logprobs(entries[start:])
        return completion_logprobs(entries[start:], self.offsets[i][start:])

    def chunks(self, step: StreamStep) -> list[dict[str, Any]]:
        first = [not self._started[delta.index] for delta in step.deltas]
        released = self._take(step)
        chunks = []
        for delta, (text, calls, added), is_first in zip(step.deltas, released, first, strict=True):
            quiet = not (text or calls or is_first or added or delta.finish_reason)
            if quiet and self.parsers[delta.index] is not None:
                continue  # a parser holding text back: nothing to tell yet
            chunks.append(self._chunk(delta, text, calls, is_first, added))
        return chunks

    def _chunk(
        self, delta: StreamDelta, text: str, calls: list[ToolCallChunk], first: bool, added: int
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
        else:
            choice = {"index": index, "text": text}
        choice["logprobs"] = self._logprobs_body(delta.index, added)
        choice["finish_reason"] = finish
        return self.envelope(
            f"{self.object_name}.chunk" if self.chat else self.object_name, [choice]
        )

    def choices(self) -> list[dict[str, Any]]:
        choices = []
        for offset, text in enumerate(self.texts):
            index = self.first_index + offset
            if self.chat:
                choice = {"index": index, "message": self._message(offset, text)}
            else:
                choice = {"index": index, "text": text}
            choice["logprobs"] = self._logprobs_body(offset)
            choice["finish_reason"] = self.finish_reasons[offset]
            if not self.chat and self.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs(self.prompt_logprobs)
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
    if head.chat and head.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs(head.prompt_logprobs)
    body["usage"] = usage(accumulators)
    return body


def _openai_finish(reason: str | None) -> str | None:
    return "stop" if reason == "abort" else reason


def embedding_list(model: str, steps: list[StreamStep], encoding_format: str) -> EmbeddingList:
    """The /v1/embeddings body: each input's embedding (its call's one step), as floats
    or base64 of their little-endian float32 bytes (what the OpenAI SDK decodes)."""

    def encoded(vector: list[float]) -> list[float] | str:
        if encoding_format == "float":
            return vector
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")

    prompt_tokens = sum(step.prompt_tokens for step in steps)
    return EmbeddingList(
        data=[
            Embedding(index=i, embedding=encoded(step.embedding)) for i, step in enumerate(steps)
        ],
        model=model,
        usage=EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens),
    )
