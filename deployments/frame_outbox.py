"""A model replica's side of the frame channels (deployments/wire.py): per ingress
replica, one socket to its frame listener and the entries its calls produced since the
last frame.

A call puts each step after its first into its ingress's outbox; the outbox's sender
task writes everything waiting as one frame (deployments/step_frames.py) when it next
runs. The engine hands a step's outputs to every request on the replica's event loop
in one callback, and each call's task runs before the sender's wake-up, so a step
becomes one frame per ingress replica, whatever the number of streams.

An outbox connects on its first call: to the ingress's Unix socket when both replicas
are on the same node, over TCP otherwise (a call whose ingress cannot be reached
streams on its own Ray stream instead). It closes when no call has used it for
`idle_close_s`, or when its socket fails: the calls it still carried then end with a
503 on their own streams, since what was buffered on a broken socket is lost.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

from loraplex.deployments.step_frames import (
    FrameItem,
    encode_frame,
    encode_hello,
    framed,
)
from loraplex.deployments.wire import FrameChannelAddress

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
IDLE_CLOSE_S = 60.0


class FrameOutbox:
    """The entries waiting for one ingress replica, and the socket they go out on."""

    def __init__(
        self,
        address: FrameChannelAddress,
        replica: str,
        node_id: str,
        idle_close_s: float,
        on_close: Callable[[FrameOutbox], None],
    ) -> None:
        self.address = address
        self.closed = False
        self.live = 0
        """Calls using this outbox now."""
        self._replica = replica
        self._node_id = node_id
        self._idle_close_s = idle_close_s
        self._on_close = on_close
        self._entries: list[tuple[int, FrameItem]] = []
        self._wakeup = asyncio.Event()
        self._writer: asyncio.StreamWriter | None = None
        self._connecting: asyncio.Future[bool] | None = None
        self._tasks: tuple[asyncio.Task, ...] = ()

    async def connected(self) -> bool:
        """Whether the socket is up (connecting once, shared by the calls that wait)."""
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
        return await asyncio.shield(self._connecting)

    def put(self, key: int, item: FrameItem) -> bool:
        """Queues `item` for the next frame; False when the outbox has closed (the
        entry cannot reach the ingress)."""
        if self.closed:
            return False
        self._entries.append((key, item))
        self._wakeup.set()
        return True

    def call_ended(self) -> None:
        self.live -= 1
        if self.live == 0:
            self._wakeup.set()

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """The ingress's Unix socket when it is on this node (TCP if that fails)."""
        address = self.address
        if address.unix_path and address.node_id == self._node_id:
            # Connected here and handed over: uvloop (Serve's loop) cannot connect to an
            # abstract name itself.
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                await asyncio.wait_for(
                    asyncio.get_running_loop().sock_connect(sock, address.unix_path),
                    CONNECT_TIMEOUT_S,
                )
                return await asyncio.open_unix_connection(sock=sock)
            except (OSError, asyncio.TimeoutError) as exc:
                sock.close()
                logger.warning("frame channel's Unix socket unreachable (%s); trying TCP", exc)
        return await asyncio.wait_for(
            asyncio.open_connection(address.host, address.port), CONNECT_TIMEOUT_S
        )

    async def _connect(self) -> bool:
        try:
            reader, writer = await self._open()
        except (OSError, asyncio.TimeoutError) as exc:
            logger.warning(
                "frame channel to %s:%d unreachable (%s); its calls stream on their own",
                self.address.host,
                self.address.port,
                exc,
            )
            self._close()
            return False
        writer.write(framed(encode_hello(self.address.token, self._replica)))
        self._writer = writer
        self._tasks = (
            asyncio.create_task(self._send()),
            asyncio.create_task(self._watch_peer(reader)),
        )
        return True

    async def _watch_peer(self, reader: asyncio.StreamReader) -> None:
        """The ingress never writes: the end of its side is the channel's end (a
        stopped or dead ingress replica), seen before anything is written into it."""
        try:
            while await reader.read(1024):
                pass
        except OSError:
            pass
        if not self.closed:
            logger.warning(
                "frame channel to %s:%d closed by the ingress; its %d open call(s) end",
                self.address.host,
                self.address.port,
                self.live,
            )
            self._close()

    async def _send(self) -> None:
        writer = self._writer
        assert writer is not None
        try:
            while not self.closed:
                if self._entries:
                    entries, self._entries = self._entries, []
                    writer.write(framed(encode_frame(entries)))
                    await writer.drain()
                    continue
                self._wakeup.clear()
                if self.live:
                    await self._wakeup.wait()
                    continue
                try:
                    await asyncio.wait_for(self._wakeup.wait(), self._idle_close_s)
                except asyncio.TimeoutError:
                    if not self.live and not self._entries:
                        return
        except (OSError, RuntimeError) as exc:
            logger.warning(
                "frame channel to %s:%d failed (%s); its %d open call(s) end",
                self.address.host,
                self.address.port,
                exc,
                self.live,
            )
        finally:
            self._close()

    def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._entries.clear()
        self._wakeup.set()
        if self._writer is not None:
            self._writer.close()
        self._on_close(self)


class FrameOutboxes:
    """This replica's outboxes, one per ingress replica its calls came from."""

    def __init__(self, replica: str, node_id: str = "", idle_close_s: float = IDLE_CLOSE_S) -> None:
        """`node_id`: the Ray node this replica runs on ("" off Ray: TCP only)."""
        self._replica = replica
        self._node_id = node_id
        self._idle_close_s = idle_close_s
        self._open: dict[FrameChannelAddress, FrameOutbox] = {}

    async def open(self, address: FrameChannelAddress) -> FrameOutbox | None:
        """The connected outbox for `address`, counting one more call on it (the call
        must `call_ended` it); None when the ingress cannot be reached."""
        outbox = self._open.get(address)
        if outbox is None:
            outbox = FrameOutbox(
                address, self._replica, self._node_id, self._idle_close_s, self._forget
            )
            self._open[address] = outbox
        outbox.live += 1
        if await outbox.connected() and not outbox.closed:
            return outbox
        outbox.call_ended()
        return None

    def _forget(self, outbox: FrameOutbox) -> None:
        if self._open.get(outbox.address) is outbox:
            del self._open[outbox.address]
