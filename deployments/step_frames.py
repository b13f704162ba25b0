"""Step frames: the compact encoding of what one model replica sends one ingress replica
per engine step over their frame channel (deployments/frame_outbox.py sends,
deployments/frame_channels.py receives).

A frame is a msgpack array of entries, one per call that gained something since the last
frame, each `[key, kind, body]`: `key` is the call's `GenerateCall.frame_key` (an int
the ingress chose), `kind` says what `body` is:

- STEP: a `StreamStep` as arrays (its deltas, their logprobs, the first step's extras);
- ERROR: a `GenerateError` (the call ends with it);
- END: the call ended normally; nothing follows for `key`.

Plain values only (no pickled objects): the receiver builds the wire's dataclasses.
On the socket every frame is preceded by its length (4 bytes, big-endian); a channel's
first frame is its hello, `[token, replica id]`.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Sequence
from typing import Any, Final

import msgpack

from loraplex.deployments.logprobs import TokenLogprob
from loraplex.deployments.wire import GenerateError, StreamDelta, StreamStep


class CallEnd:
    """The item a call's frames end with when it ended without an error."""

    def __repr__(self) -> str:
        return "CALL_END"


CALL_END: Final = CallEnd()

FrameItem = StreamStep | GenerateError | CallEnd

STEP, ERROR, END = 0, 1, 2
LENGTH = struct.Struct("!I")
MAX_FRAME_BYTES = 64 << 20
"""A longer length prefix is a broken or foreign peer: the channel closes."""


def framed(payload: bytes) -> bytes:
    """`payload` with its length prefix, as written to the socket."""
    return LENGTH.pack(len(payload)) + payload


async def read_framed(reader: asyncio.StreamReader) -> bytes:
    """The next frame's payload; IncompleteReadError at the end of the stream,
    ValueError for a length past MAX_FRAME_BYTES."""
    (length,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {length} bytes is over the {MAX_FRAME_BYTES} limit")
    return await reader.readexactly(length)


def encode_hello(token: str, replica: str) -> bytes:
    return msgpack.packb([token, replica], use_bin_type=True)


def decode_hello(payload: bytes) -> tuple[str, str]:
    """(token, replica id); ValueError for anything else."""
    try:
        token, replica = msgpack.unpackb(payload, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ValueError(f"not a hello: {exc}") from None
    if not isinstance(token, str) or not isinstance(replica, str):
        raise ValueError("not a hello: token and replica must be strings")
    return token, replica


def encode_frame(entries: Sequence[tuple[int, FrameItem]]) -> bytes:
    """One frame holding `entries` (call key, item), in order."""
    return msgpack.packb([_entry(key, item) for key, item in entries], use_bin_type=True)


def decode_frame(frame: bytes) -> list[tuple[int, FrameItem]]:
    """`encode_frame`'s entries back; ValueError for a frame this module did not write."""
    try:
        raw = msgpack.unpackb(frame, raw=False, strict_map_key=False)
        return [(int(key), _item(kind, body)) for key, kind, body in raw]
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ValueError(f"not a step frame: {exc}") from None


def _entry(key: int, item: FrameItem) -> list[Any]:
    if isinstance(item, StreamStep):
        return [key, STEP, _step(item)]
    if isinstance(item, GenerateError):
        return [key, ERROR, [item.status, item.message, item.param, item.retry_after_s, item.code]]
    return [key, END, None]


def _item(kind: int, body: Any) -> FrameItem:
    if kind == STEP:
        return _read_step(body)
    if kind == ERROR:
        status, message, param, retry_after_s, code = body
        return GenerateError(status, message, param, retry_after_s, code)
    if kind == END:
        return CALL_END
    raise ValueError(f"unknown entry kind {kind!r}")


def _step(step: StreamStep) -> list[Any]:
    deltas = [
        [d.index, d.text, d.num_new_tokens, d.finish_reason, _logprobs(d.logprobs)]
        for d in step.deltas
    ]
    extras = {}
    if step.echo_text is not None:
        extras["echo_text"] = step.echo_text
    if step.tool_call_format is not None:
        extras["tool_call_format"] = step.tool_call_format
    if step.prompt_logprobs is not None:
        extras["prompt_logprobs"] = _logprobs(step.prompt_logprobs)
    if step.embedding is not None:
        extras["embedding"] = step.embedding
    if step.replica is not None:
        extras["replica"] = step.replica
    return [step.prompt_tokens, step.worst_case_tokens, step.cached_tokens, deltas, extras]


def _read_step(body: list[Any]) -> StreamStep:
    prompt_tokens, worst_case, cached, raw_deltas, extras = body
    deltas = [
        StreamDelta(index, text, new_tokens, finish, _read_logprobs(logprobs))
        for index, text, new_tokens, finish, logprobs in raw_deltas
    ]
    prompt_logprobs = extras.get("prompt_logprobs")
    return StreamStep(
        prompt_tokens,
        deltas,
        worst_case,
        cached,
        echo_text=extras.get("echo_text"),
        tool_call_format=extras.get("tool_call_format"),
        prompt_logprobs=None if prompt_logprobs is None else _read_logprobs(prompt_logprobs),
        embedding=extras.get("embedding"),
        replica=extras.get("replica"),
    )


def _logprobs(entries: Sequence[TokenLogprob]) -> list[list[Any]]:
    return [[e.token_id, e.token, e.logprob, [list(t) for t in e.top], e.rank] for e in entries]


def _read_logprobs(raw: list[list[Any]]) -> list[TokenLogprob]:
    return [
        TokenLogprob(token_id, token, logprob, tuple(tuple(t) for t in top), rank)
        for token_id, token, logprob, top, rank in raw
    ]
