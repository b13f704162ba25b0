"""Tool calls: what `tool_choice` makes the model write, and how its text is read back
into OpenAI `tool_calls`.

- `required`: the output is guided (structured output) to a JSON array of calls,
  `[{"name": "<a tool>", "arguments": {...its parameters...}}, ...]`, at least one, at
  most one when `parallel_tool_calls` is false; `finish_reason` is `tool_calls`.
- a named function: the output is guided to that function's parameters schema and is
  its call's `arguments`, streamed as they are written; `finish_reason` stays `stop`
  (as OpenAI answers a forced call).
- `auto`: the model writes what it wants; where the chat template defines a tool-call
  format (`platform/tokenizer.py tool_call_format`: today Hermes' `<tool_call>{...}
  </tool_call>` blocks, which Qwen2.5, Hermes and SmolLM3 templates use), the blocks
  become tool calls and the text around them stays content; other models answer text.
- `none`: no tool call is read.

A parser turns a completion's text deltas into (content text, tool-call chunks) as the
OpenAI stream has them: a call's first chunk carries its `id` and `name`, later ones
more `arguments` text.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from loraplex.platform.guided import GuidedSpec

ToolChoiceKind = Literal["none", "auto", "required", "named"]
HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
"""A function without `parameters` takes none: its arguments are `{}`."""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCalling:
    """A chat request's tools (OpenAI `function` definitions as chat templates read
    them) and what `tool_choice` asks of the answer."""

    tools: tuple[dict[str, Any], ...]
    choice: ToolChoiceKind
    function: str | None = None
    """The function a named `tool_choice` forces."""
    parallel: bool = True
    """False: `required` makes exactly one call."""

    def parameters(self, name: str) -> dict[str, Any]:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return tool["function"].get("parameters") or NO_PARAMETERS
        raise KeyError(name)

    def guided_spec(self) -> GuidedSpec | None:
        """The structure `required` and a named function force; None otherwise."""
        if self.choice == "named":
            schema = self.parameters(self.function or "")
            origin = f"tools[{self._index(self.function)}].function.parameters"
            return GuidedSpec("json_schema", json.dumps(schema, sort_keys=True), origin)
        if self.choice != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": tool["function"]["name"]},
                    "arguments": tool["function"].get("parameters") or NO_PARAMETERS,
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for tool in self.tools
        ]
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        # Key order kept: each call's name comes before its arguments.
        return GuidedSpec("json_schema", json.dumps(schema), "tools")

    def _index(self, name: str | None) -> int:
        names = [tool["function"]["name"] for tool in self.tools]
        return names.index(name)

    def parser(self, template_format: str | None) -> ToolCallParser | None:
        """A fresh parser for one completion; None when its text is plain content.
        `template_format`: the model's tool-call format (`tool_call_format`)."""
        if self.choice == "named":
            return NamedCallParser(self.function or "")
        if self.choice == "required":
            return CallArrayParser()
        if self.choice == "auto" and template_format == "hermes":
            return HermesParser()
        return None


@dataclass(frozen=True)
class ToolCallChunk:
    """One piece of a tool call as the stream carries it."""

    index: int
    arguments: str
    id: str | None = None
    """Set on a call's first chunk, with its `name`."""
    name: str | None = None

    def as_delta(self) -> dict[str, Any]:
        chunk: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.id is not None:
            chunk["id"] = self.id
            chunk["type"] = "function"
            function = {"name": self.name, "arguments": self.arguments}
        chunk["function"] = function
        return chunk


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str
    """JSON text of the arguments object."""

    def as_message_part(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


Parsed = tuple[str, list[ToolCallChunk]]
"""(content text, tool-call chunks) a parser releases."""


class ToolCallParser(Protocol):
    calls: list[ToolCall]
    finish_as_tool_calls: bool
    """True: a completion that stopped with calls reports `tool_calls` as its reason."""

    def feed(self, text: str) -> Parsed:
        """Takes a completion's next text; returns what can be released now."""

    def finish(self) -> Parsed:
        """The completion ended: releases whatever was held back."""


@dataclass
class NamedCallParser:
    """The whole output is the arguments of one call to `name`, streamed as written."""

    name: str
    calls: list[ToolCall] = field(default_factory=list)
    finish_as_tool_calls: bool = False

    def feed(self, text: str) -> Parsed:
        if not self.calls:
            call = ToolCall(new_call_id(), self.name, text)
            self.calls.append(call)
            return "", [ToolCallChunk(0, text, call.id, self.name)]
        self.calls[0].arguments += text
        return "", [ToolCallChunk(0, text)] if text else []

    def finish(self) -> Parsed:
        return self.feed("") if not self.calls else ("", [])


def _call_from(value: object, name_key: str = "name") -> ToolCall | None:
    """A call from `{"name": str, "arguments": object or JSON text}`; None otherwise."""
    if not isinstance(value, dict) or not isinstance(value.get(name_key), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    text = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(new_call_id(), value[name_key], text)


def _chunks(calls: list[ToolCall], first_index: int) -> list[ToolCallChunk]:
    return [
        ToolCallChunk(first_index + i, call.arguments, call.id, call.name)
        for i, call in enumerate(calls)
    ]


@dataclass
class CallArrayParser:
    """`required`: the output is a JSON array of calls, released when complete (a
    truncated array stays content)."""

    calls: list[ToolCall] = field(default_factory=list)
    finish_as_tool_calls: bool = True
    _text: str = ""

    def feed(self, text: str) -> Parsed:
        self._text += text
        return "", []

    def finish(self) -> Parsed:
        try:
            value = json.loads(self._text)
        except (ValueError, RecursionError):
            value = None
        calls = [_call_from(item) for item in value] if isinstance(value, list) else [None]
        if not calls or any(call is None for call in calls):
            return self._text, []
        self.calls = [call for call in calls if call is not None]
        return "", _chunks(self.calls, 0)


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that starts `marker` (to hold back)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


@dataclass
class HermesParser:
    """`auto` on a Hermes-format template: `<tool_call>{"name": ..., "arguments": ...}
    </tool_call>` blocks are calls, released as each closes; text around them is
    content (a block that does not parse as a call stays content too)."""

    calls: list[ToolCall] = field(default_factory=list)
    finish_as_tool_calls: bool = True
    _pending: str = ""
    _in_call: bool = False

    def feed(self, text: str) -> Parsed:
        self._pending += text
        content: list[str] = []
        chunks: list[ToolCallChunk] = []
        while True:
            if not self._in_call:
                start = self._pending.find(HERMES_OPEN)
                if start < 0:
                    keep = _held_prefix(self._pending, HERMES_OPEN)
                    cut = len(self._pending) - keep
                    content.append(self._pending[:cut])
                    self._pending = self._pending[cut:]
                    break
                content.append(self._pending[:start])
                self._pending = self._pending[start + len(HERMES_OPEN) :]
                self._in_call = True
            end = self._pending.find(HERMES_CLOSE)
            if end < 0:
                break
            body, self._pending = self._pending[:end], self._pending[end + len(HERMES_CLOSE) :]
            self._in_call = False
            released, block = self._block(body, closed=True)
            content.append(released)
            chunks.extend(block)
        return "".join(content), chunks

    def _block(self, body: str, closed: bool) -> Parsed:
        try:
            call = _call_from(json.loads(body))
        except (ValueError, RecursionError):
            call = None
        if call is None:
            return HERMES_OPEN + body + (HERMES_CLOSE if closed else ""), []
        self.calls.append(call)
        return "", _chunks([call], len(self.calls) - 1)

    def finish(self) -> Parsed:
        pending, self._pending = self._pending, ""
        if self._in_call:
            self._in_call = False
            return self._block(pending, closed=False)
        return pending, []
