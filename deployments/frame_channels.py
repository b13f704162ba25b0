"""An ingress replica's side of the frame channels (deployments/wire.py): the listener
model replicas connect to, and each call's items as one async iterator.

Every model replica that serves this ingress's calls keeps one socket to the listener
(deployments/frame_outbox.py) and writes one frame per engine step for all of them. The
reader of each socket hands every entry to its call's `CallSteps` by the call's frame
key; the HTTP side reads a `CallSteps` exactly as it would read Serve's response
generator (`anext` for the next item, `cancel()` to end the call early, which cancels
the call's Ray stream and so aborts the request in the engine).

Failures stay per call: a socket that ends or breaks while it still carries calls fails
exactly those calls with `FrameChannelLost`; a call whose model replica dies or raises
gets that error from its own Ray stream, which stays open for its whole life.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import secrets
import sys
from collections.abc import Callable
from typing import Any

from ray.exceptions import RayError

from loraplex.deployments.step_frames import (
    CALL_END,
    FrameItem,
    decode_frame,
    decode_hello,
    read_framed,
)
from loraplex.deployments.wire import FrameChannelAddress, GenerateError, StreamStep

logger = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0
END_GRACE_S = 10.0
"""How long after a framed call's own stream ended its end may still be on the way."""


class FrameChannelLost(RayError):
    """The frame channel that carried a call ended before the call did."""


class CallSteps:
    """One call's items: the first from its Ray stream, the rest from its replica's
    frames when the first says so (`StreamStep.replica`), else from the stream too."""

    def __init__(self, channels: FrameChannels, key: int, stream: Any) -> None:
        self.key = key
        self._channels = channels
        self._stream = stream
        self._queue: asyncio.Queue[FrameItem | BaseException] = asyncio.Queue()
        self._first = True
        self._framed = False
        self._ended = False
        self._watch: asyncio.Task | None = None

    def __aiter__(self) -> CallSteps:
        return self

    async def __anext__(self) -> StreamStep | GenerateError:
        if self._ended:
            raise StopAsyncIteration
        if self._first:
            return await self._first_item()
        if not self._framed:
            try:
                return await anext(self._stream)
            except BaseException:
                self._end()
                raise
        item = await self._queue.get()
        if item is CALL_END:
            self._end()
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._end()
            raise item
        if isinstance(item, GenerateError):
            self._end()
        return item

    def deliver(self, item: FrameItem | BaseException) -> None:
        self._queue.put_nowait(item)

    def cancel(self) -> None:
        """Ends the call: its Ray stream is cancelled (the replica aborts the request)."""
        self._stream.cancel()
        self._end()

    async def _first_item(self) -> StreamStep | GenerateError:
        try:
            item = await anext(self._stream)
        except BaseException:
            self._end()
            raise
        self._first = False
        if isinstance(item, StreamStep) and item.replica is not None:
            self._framed = True
            self._watch = asyncio.create_task(self._watch_stream())
        else:
            self._channels.forget(self.key)
        return item

    async def _watch_stream(self) -> None:
        """A framed call's Ray stream carries nothing more but its failure, or a
        GenerateError when its replica lost the channel. Its end means the replica put
        the call's last entry on the socket: an end not there `END_GRACE_S` later was
        lost with a socket that broke."""
        try:
            async for item in self._stream:
                self.deliver(item)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.deliver(exc)
            return
        await asyncio.sleep(END_GRACE_S)
        self.deliver(FrameChannelLost("the call's last frames were lost with its channel"))

    def _end(self) -> None:
        self._ended = True
        self._channels.forget(self.key)
        if self._watch is not None and asyncio.current_task() is not self._watch:
            self._watch.cancel()


class FrameChannels:
    """This ingress replica's frame listeners (started on first use) and its calls.

    Model replicas on other nodes connect over TCP; on Linux, those on this replica's
    own node (`node_id`) connect to a Unix socket instead, which costs the kernel less
    per frame than a loopback TCP connection (no TCP and IP stack on either side)."""

    def __init__(
        self, host: str, on_frame: Callable[[int], None] | None = None, node_id: str = ""
    ) -> None:
        """`on_frame(entries)`: called for every frame received (metrics). `node_id`:
        the Ray node this replica runs on ("" off Ray: TCP only)."""
        self._host = host
        self._on_frame = on_frame
        self._node_id = node_id
        self._token = secrets.token_hex(16)
        self._starting: asyncio.Future[FrameChannelAddress] | None = None
        self._servers: list[asyncio.Server] = []
        self._calls: dict[int, CallSteps] = {}
        self._keys = itertools.count(1)

    async def address(self) -> FrameChannelAddress:
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._listen())
        return await asyncio.shield(self._starting)

    async def _listen(self) -> FrameChannelAddress:
        tcp = await asyncio.start_server(self._serve_replica, self._host, 0)
        self._servers.append(tcp)
        port = tcp.sockets[0].getsockname()[1]
        unix_path = ""
        if self._node_id and sys.platform == "linux":
            # An abstract name: no file to clean up, gone with the process.
            name = f"\0loraplex-frames-{secrets.token_hex(16)}"
            try:
                self._servers.append(await asyncio.start_unix_server(self._serve_replica, name))
                unix_path = name
            except OSError as exc:
                logger.warning("no Unix socket for frames (%s); model replicas use TCP", exc)
        return FrameChannelAddress(self._host, port, self._token, self._node_id, unix_path)

    def new_key(self) -> int:
        return next(self._keys)

    def steps(self, key: int, stream: Any) -> CallSteps:
        """The items of the call sent with `key`, whose Ray stream is `stream`."""
        steps = CallSteps(self, key, stream)
        self._calls[key] = steps
        return steps

    def forget(self, key: int) -> None:
        self._calls.pop(key, None)

    @property
    def open_calls(self) -> int:
        return len(self._calls)

    async def _serve_replica(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        replica = "?"
        carried: set[int] = set()
        """Keys this socket delivered to that have not ended."""
        reason = "closed"
        try:
            token, replica = decode_hello(
                await asyncio.wait_for(read_framed(reader), HELLO_TIMEOUT_S)
            )
            if not hmac.compare_digest(token.encode(), self._token.encode()):
                logger.warning("frame channel refused: a peer without this app's token")
                return
            while True:
                entries = decode_frame(await read_framed(reader))
                if self._on_frame is not None:
                    self._on_frame(len(entries))
                for key, item in entries:
                    steps = self._calls.get(key)
                    if steps is None:
                        continue
                    steps.deliver(item)
                    if item is CALL_END or isinstance(item, GenerateError):
                        carried.discard(key)
                    else:
                        carried.add(key)
        except asyncio.IncompleteReadError:
            pass
        except asyncio.CancelledError:
            reason = "the listener stopped"
        except (OSError, ValueError, asyncio.TimeoutError) as exc:
            reason = str(exc) or type(exc).__name__
        finally:
            writer.close()
            lost = [self._calls[key] for key in carried if key in self._calls]
            if lost:
                logger.warning(
                    "frame channel from replica %s ended (%s) with %d call(s) open",
                    replica,
                    reason,
                    len(lost),
                )
            for steps in lost:
                steps.deliver(
                    FrameChannelLost(f"the frame channel from model replica {replica} ended")
                )
