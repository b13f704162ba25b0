"""AsyncEngine: the LLMEngine's step loop on a background thread, fed by coroutines.

`generate()` validates in the caller (bad input raises ValueError there), waits for
its adapter to load (on the adapter store's threads, so the step loop keeps serving
other requests meanwhile), hands the request to the loop thread and yields cumulative RequestOutputs as they arrive; when
the consumer lags, only the newest output is kept (each one contains the previous).
Leaving the iterator early (client disconnect, cancellation) aborts the request, which
frees its KV blocks on the next loop turn. If the loop dies, every waiting consumer
gets an EngineDeadError and `check_health()` raises it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from loraplex.adapters.peft_format import LoRAAdapter
from loraplex.platform.engine import LLMEngine
from loraplex.platform.request import Request, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can make progress on this engine."""


@dataclass(frozen=True)
class _Add:
    group: list[Request]


@dataclass(frozen=True)
class _Abort:
    request_id: str


class _Stream:
    """Hands one request's outputs from the loop thread to its coroutine."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def newest(self) -> RequestOutput:
        item = await self._queue.get()
        while not self._queue.empty() and not isinstance(item, BaseException):
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            raise item
        return item


class AsyncEngine:
    def __init__(self, engine: LLMEngine, idle_poll_s: float = 0.5) -> None:
        self.engine = engine
        self._idle_poll_s = idle_poll_s
        self._commands: queue.SimpleQueue[_Add | _Abort] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._stopping = threading.Event()
        self.last_step_time = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="loraplex-engine", daemon=True)
        self._thread.start()

    # ---- client side ---------------------------------------------------------------
    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        adapter: str | LoRAAdapter | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields cumulative outputs until the request finishes. ValueError on bad input
        (an unknown or invalid adapter included). `adapter`: a registered name, an
        adapter folder or a loaded adapter; None runs the base model."""
        self.check_health()
        request_id = request_id or uuid.uuid4().hex
        lora = await self.load_adapter(adapter)
        group = self.engine.make_request_group(request_id, prompt, params, priority, lora=lora)
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
        self._send(_Add(group))
        finished = False
        try:
            while not finished:
                output = await stream.newest()
                finished = output.finished
                yield output
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self._send(_Abort(request_id))

    async def load_adapter(
        self, adapter: str | LoRAAdapter | None, name: str | None = None
    ) -> LoRAAdapter | None:
        """Loads an adapter (a registered name or a folder, labelled `name`) off the event
        loop and off the engine loop."""
        if adapter is None or isinstance(adapter, LoRAAdapter):
            return adapter
        if self.engine.adapters is None:
            raise ValueError("LoRA is disabled on this engine (max_loras=0)")
        return await asyncio.wrap_future(self.engine.adapters.load_async(adapter, name))

    def abort(self, request_id: str) -> None:
        self._send(_Abort(request_id))

    def check_health(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"engine loop died: {self._error!r}") from self._error
        if not self._thread.is_alive():
            raise EngineDeadError("engine loop is not running")
        try:
            self.engine.check_health()
        except RuntimeError as exc:
            raise EngineDeadError(str(exc)) from exc

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Stops the loop, first letting in-flight requests finish for up to the timeout."""
        deadline = time.monotonic() + drain_timeout_s
        while self._streams and time.monotonic() < deadline and self._error is None:
            time.sleep(0.05)
        self._stopping.set()
        self._wakeup.set()
        self._thread.join(timeout=10)
        self.engine.shutdown()

    def _send(self, command: _Add | _Abort) -> None:
        self._commands.put(command)
        self._wakeup.set()

    # ---- loop thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._apply_commands()
                if not self.engine.has_unfinished():
                    self._wakeup.wait(self._idle_poll_s)
                    self._wakeup.clear()
                    self.last_step_time = time.monotonic()
                    continue
                for output in self.engine.step():
                    self._deliver(output.request_id, output)
                self.last_step_time = time.monotonic()
        except BaseException as exc:
            self._error = exc
            logger.exception("engine loop died")
            dead = EngineDeadError(f"engine loop died: {exc!r}")
            with self._lock:
                streams = list(self._streams.values())
            for stream in streams:
                stream.put(dead)

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                request_id = command.group[0].group_id
                try:
                    self.engine.add_group(command.group)
                except ValueError as exc:
                    self._deliver(request_id, exc)
            else:
                output = self.engine.abort_request(command.request_id)
                if output is not None:
                    self._deliver(command.request_id, output)
                    logger.info("request %s aborted", command.request_id)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(item)
