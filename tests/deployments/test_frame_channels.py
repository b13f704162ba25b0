"""Frame channels (deployments/step_frames.py, frame_outbox.py, frame_channels.py):
the frame encoding round trip, then a real ModelServer (a tiny engine, no Serve) whose
calls' later steps travel over a real socket to an ingress-side listener: the items
equal the calls' own streams, a step is one frame for every call, a cancelled call
frees its KV blocks while the others finish, a channel that breaks fails exactly
the calls it carried, and a model replica on the ingress's node connects over its Unix
socket."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import sys

import msgpack
import pytest
import uvloop

from loraplex.deployments.frame_channels import CallSteps, FrameChannelLost, FrameChannels
from loraplex.deployments.frame_outbox import FrameOutboxes
from loraplex.deployments.logprobs import TokenLogprob
from loraplex.deployments.step_frames import (
    CALL_END,
    decode_frame,
    decode_hello,
    encode_frame,
    encode_hello,
)
from loraplex.deployments.wire import GenerateCall, GenerateError, StreamDelta, StreamStep
from loraplex.platform.request import SamplingParams


def test_a_frame_gives_back_its_steps_errors_and_ends():
    logprob = TokenLogprob(7, "é", -0.25, ((7, "é", -0.25), (9, " x", -1.5)), None)
    first = StreamStep(
        12,
        [StreamDelta(0, "Hé", 2, None, [logprob]), StreamDelta(1, "", 0, "stop")],
        worst_case_tokens=40,
        cached_tokens=8,
        echo_text="prompt",
        tool_call_format="hermes",
        prompt_logprobs=[TokenLogprob(1, "<s>", None, ()), logprob],
        replica="r1",
    )
    entries = [
        (1, first),
        (2, StreamStep(3, [], embedding=[0.5, -1.0])),
        (3, GenerateError(503, "busy", param="model", retry_after_s=2, code="overloaded")),
        (1, CALL_END),
    ]
    assert decode_frame(encode_frame(entries)) == entries
    assert decode_hello(encode_hello("secret", "replica-a")) == ("secret", "replica-a")


@pytest.mark.parametrize(
    "payload", [b"\x00\x01", msgpack.packb([[1, 9, None]]), msgpack.packb({"a": 1})]
)
def test_a_foreign_frame_is_refused(payload):
    with pytest.raises(ValueError):
        decode_frame(payload)
    with pytest.raises(ValueError):
        decode_hello(payload)


class LocalCallStream:
    """A replica generator behind the two things the ingress uses of Serve's response
    generator: `anext` and `cancel()` (which Serve turns into a cancelled call)."""

    def __init__(self, items) -> None:
        self._items = items
        self._pending: asyncio.Future | None = None

    def __aiter__(self) -> LocalCallStream:
        return self

    async def __anext__(self):
        self._pending = asyncio.ensure_future(anext(self._items))
        return await self._pending

    def cancel(self) -> None:
        if self._pending is not None:
            self._pending.cancel()


@pytest.fixture(scope="module")
def server(tiny_model_factory, tmp_path_factory):
    from loraplex.deployments.config import ModelDeploymentConfig
    from loraplex.deployments.model_server import LocalPlace, ModelServer

    config = ModelDeploymentConfig(
        name="framed",
        model=str(tiny_model_factory("llama")),
        engine={
            "dtype": "float32",
            "max_model_len": 256,
            "max_num_seqs": 8,
            "max_loras": 0,
            "kv_cache_memory_bytes": 1 << 23,
        },
    )
    server = ModelServer(config, str(tmp_path_factory.mktemp("adapters")), place=LocalPlace())
    yield server
    server.engine.shutdown()


def calls(count: int, max_tokens: int = 12) -> list[GenerateCall]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=1)
    return [
        GenerateCall(f"c{i}", params, prompt=[1 + i, 5, 9, 2 + i], echo=True) for i in range(count)
    ]


async def drain(steps) -> list:
    return [item async for item in steps]


def start_framed(server, channels: FrameChannels, address, call: GenerateCall) -> CallSteps:
    key = channels.new_key()
    framed = dataclasses.replace(call, frames_to=address, frame_key=key)
    return channels.steps(key, LocalCallStream(server.generate(framed)))


def completions(items: list) -> dict[int, tuple]:
    """Per completion: its text, tokens, logprobs and finish reason over every step
    (how a stream's tokens fall into steps depends on timing)."""
    merged: dict[int, tuple] = {}
    for item in items:
        for d in item.deltas:
            text, tokens, logprobs, _ = merged.get(d.index, ("", 0, [], None))
            merged[d.index] = (
                text + d.text,
                tokens + d.num_new_tokens,
                logprobs + d.logprobs,
                d.finish_reason,
            )
    return merged


def test_framed_calls_equal_their_own_streams_in_one_frame_per_step(server):
    frame_sizes: list[int] = []
    """Entries per frame received."""

    async def scenario():
        direct = await asyncio.gather(*(drain(server.generate(c)) for c in calls(6)))
        channels = FrameChannels("127.0.0.1", frame_sizes.append)
        address = await channels.address()
        framed = await asyncio.gather(
            *(drain(start_framed(server, channels, address, c)) for c in calls(6))
        )
        return direct, framed, channels

    direct, framed, channels = asyncio.run(scenario())
    for own, via_frames in zip(direct, framed, strict=True):
        assert via_frames[0].replica == "local"
        assert via_frames[0].echo_text == own[0].echo_text
        assert completions(via_frames) == completions(own)
        assert completions(own)[0][1:4:2] == (12, "length")
    assert channels.open_calls == 0
    # Each call sends at most its 11 steps after the first (fewer where the engine ran
    # ahead of the call's task: outputs are cumulative) and its end; the 6 calls share
    # each step's frame, so a frame carries several entries.
    assert 6 * 2 <= sum(frame_sizes) <= 6 * 12
    assert len(frame_sizes) * 3 <= sum(frame_sizes)
    assert server.engine.snapshot().block_refs == 0


def test_a_cancelled_call_is_aborted_and_frees_its_blocks_while_the_others_finish(server):
    async def scenario():
        channels = FrameChannels("127.0.0.1")
        address = await channels.address()
        started = [start_framed(server, channels, address, c) for c in calls(3, 40)]
        firsts = [await anext(steps) for steps in started]
        started[1].cancel()
        rest = await asyncio.gather(drain(started[0]), drain(started[2]))
        return firsts, rest, channels

    firsts, rest, channels = asyncio.run(scenario())
    assert all(first.replica == "local" for first in firsts)
    for first, items in zip((firsts[0], firsts[2]), rest, strict=True):
        tokens = sum(d.num_new_tokens for step in (first, *items) for d in step.deltas)
        assert tokens == 40
    assert channels.open_calls == 0
    snapshot = server.engine.snapshot()
    assert snapshot.block_refs == 0 and snapshot.streams == 0


def test_a_broken_channel_fails_the_calls_it_carried_and_nothing_else(server):
    async def scenario():
        channels = FrameChannels("127.0.0.1")
        address = await channels.address()
        started = [start_framed(server, channels, address, c) for c in calls(2, 60)]
        for steps in started:
            await anext(steps)
            await anext(steps)
        outbox = server.outboxes._open[address]
        outbox._writer.transport.abort()
        outcomes = []
        for steps in started:
            try:
                outcomes.append(await drain(steps))
            except FrameChannelLost as exc:
                outcomes.append(exc)
        # A new call after the break (which the replica saw) opens a new channel.
        await asyncio.sleep(0.2)
        assert outbox.closed
        after = await drain(start_framed(server, channels, address, calls(1, 8)[0]))
        return outcomes, after

    outcomes, after = asyncio.run(scenario())
    for outcome in outcomes:
        lost = isinstance(outcome, FrameChannelLost)
        ended_503 = isinstance(outcome, list) and isinstance(outcome[-1], GenerateError)
        assert lost or ended_503, outcome
        if ended_503:
            assert outcome[-1].status == 503
    assert sum(d.num_new_tokens for step in after for d in step.deltas) == 8
    assert server.engine.snapshot().block_refs == 0


@pytest.mark.skipif(sys.platform != "linux", reason="abstract Unix socket names are Linux's")
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_replica_on_the_ingress_node_connects_over_its_unix_socket(loop):
    """The same node: the ingress's Unix socket; another node: TCP. Both carry frames
    (the listener counts a frame before it looks for the calls it names). Under uvloop
    too, which Serve's replicas run on."""

    async def scenario():
        frames: list[int] = []
        channels = FrameChannels("127.0.0.1", frames.append, node_id="node-a")
        address = await channels.address()
        families = {}
        for node in ("node-a", "node-b"):
            outbox = await FrameOutboxes(f"replica-on-{node}", node_id=node).open(address)
            assert outbox is not None
            families[node] = outbox._writer.get_extra_info("socket").family
            count = len(frames)
            outbox.put(1, CALL_END)
            for _ in range(200):
                if len(frames) > count:
                    break
                await asyncio.sleep(0.01)
            outbox.call_ended()
        return address, families, frames

    run = uvloop.run if loop == "uvloop" else asyncio.run
    address, families, frames = run(scenario())
    assert address.node_id == "node-a" and address.unix_path.startswith("\0")
    assert families == {"node-a": socket.AF_UNIX, "node-b": socket.AF_INET}
    assert frames == [1, 1]


def test_a_listener_off_ray_has_no_unix_socket():
    async def scenario():
        return await FrameChannels("127.0.0.1").address()

    address = asyncio.run(scenario())
    assert address.unix_path == "" and address.node_id == ""
