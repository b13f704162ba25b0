"""AsyncEngine: the LLMEngine's step loop on a background thread, fed by coroutines.

`AsyncEngine.build` builds the engine on the loop thread itself, so one thread runs
all of its compute (platform/compute_threads.py). `generate()` validates in the caller
(bad input raises ValueError there), waits for its adapter to load (on the adapter
store's threads, so the step loop keeps serving other requests meanwhile) and for its
grammar to compile (structured output, on a worker thread), hands the
request to the loop thread and yields its RequestOutputs (cumulative, or deltas when the
request's `output_kind` asks) as they arrive; outputs a lagging consumer has not taken
are merged into one, and when many requests stream at once each yields every few steps
(`_Coalescing`). A caller may instead take every output between the first and the last
in a callback on its event loop (`forward`), which a model server uses to write them
straight into its frames.
Leaving the iterator early (client disconnect, cancellation) aborts the request, which
frees its KV blocks on the next loop turn.

Failures stay as small as they can:
- a request the engine ended early (its sampling failed, its adapter produced NaN)
  raises `RequestFailedError` in its own consumer only;
- a step that fails for any other reason may have left shared state (KV cache, LoRA
  slots) half-written: the loop fails every in-flight request with `EngineRestartedError`,
  resets the engine (`LLMEngine.reset`: same weights, fresh blocks and slots) and goes on
  serving, in well under a second;
- a fault that persists (more than `Supervision.max_restarts` restarts within
  `restart_window_s`) stops the loop instead of failing every tenant's requests on every
  restart: `check_health()` then raises, and Serve replaces the replica;
- a step that makes no progress for `Supervision.step_watchdog_s` while work is queued
  (a hung kernel, a deadlocked collective) fails every stream with `EngineStalledError`
  and makes `check_health()` raise, so Serve replaces the replica;
- a shutdown fails the streams still open when its drain ends (`EngineStoppedError`);
- `sleep` refuses new requests (`EngineAsleepError`), lets the open ones finish, then
  has the loop thread release the engine's memory (platform/sleep_mode.py); `wake_up`
  takes it back and lets requests in again;
- only when a reset is impossible (tensor parallelism: a worker may be stuck in a
  collective) or fails does the loop die: every consumer gets an EngineDeadError,
  `check_health()` raises it, and Serve replaces the replica.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from loraplex.adapters.peft_format import LoRAAdapter
from loraplex.platform.arch import ModelArch
from loraplex.platform.config import EngineConfig
from loraplex.platform.engine import EngineSnapshot, LLMEngine
from loraplex.platform.request import (
    Request,
    RequestFailure,
    RequestOutput,
    SamplingParams,
    merge_outputs,
)
from loraplex.platform.request_limits import EngineLimits
from loraplex.platform.sleep_mode import SleepReport
from loraplex.platform.thread_names import COMPUTE_THREAD_NAME, name_this_thread
from loraplex.platform.tokenizer import apply_chat_template, encode_text, tool_call_format

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can make progress on this engine."""


class EngineStalledError(EngineDeadError):
    """No step finished for longer than the step watchdog allows while work was queued."""


class EngineAsleepError(RuntimeError):
    """The engine sleeps (its memory lent to another job); it takes no request."""


class EngineStoppedError(RuntimeError):
    """The engine was shut down (the replica is stopping) before this request ended."""


class EngineRestartedError(RuntimeError):
    """A step failed outside any one request; the engine dropped every in-flight
    request and restarted in place. A retry is served by the same engine."""


class RequestFailedError(RuntimeError):
    """The engine ended this request early; the rest of its batch ran on."""

    def __init__(self, failure: RequestFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


@dataclass(frozen=True)
class Supervision:
    """When the loop gives up on itself (module docstring)."""

    max_restarts: int = 3
    """In-place restarts allowed within `restart_window_s`; one more stops the loop."""
    restart_window_s: float = 60.0
    step_watchdog_s: float | None = 120.0
    """A step (or the loop turn around it) running this long while requests are queued
    fails the engine; None: never."""


@dataclass(frozen=True)
class _Add:
    group: list[Request]


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Call:
    """Runs `work` on the loop thread between steps; its result or error goes to
    `done`."""

    work: Callable[[], object]
    done: concurrent.futures.Future


class _Stream:
    """Hands one request's outputs from the loop thread to its consumer, on the
    consumer's event loop (`take`, called there): an output held back (`_Coalescing`) is
    merged into the next one; the rest are queued for the request's iterator, or, past
    the first and before the last, given to `forward` when the caller named one."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        kind: str,
        coalescing: _Coalescing,
        forward: Callable[[RequestOutput], None] | None,
    ) -> None:
        self.loop = loop
        self.kind = kind
        self.coalescing = coalescing
        self.forward = forward
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._held: RequestOutput | None = None
        self._queued_first = False
        self._failed = False
        """`forward` raised: the request ends with that error, nothing more is taken."""

    def put(self, item: RequestOutput | BaseException) -> None:
        """From any thread: `take` on the consumer's loop."""
        self.loop.call_soon_threadsafe(self.take, item, 1)

    def take(self, item: RequestOutput | BaseException, outputs_per_step: int) -> None:
        if self._failed:
            return
        if isinstance(item, BaseException):
            self.queue.put_nowait(item)
            return
        if self._held is not None:
            item, self._held = merge_outputs(self._held, item, self.kind), None
        last = item.finished or item.error is not None
        if not last and self.coalescing.holds_back(False, outputs_per_step):
            self._held = item
            return
        if self.forward is None or last or not self._queued_first:
            self._queued_first = True
            self.queue.put_nowait(item)
            return
        try:
            self.forward(item)
        except Exception as exc:
            self._failed = True
            self.queue.put_nowait(exc)

    async def next(self) -> RequestOutput:
        """The next queued output; raises a queued error instead. Without `forward`, the
        outputs queued behind it are merged into it (a consumer that lagged gets them as
        one); with it, the first and the last are kept apart, since the outputs between
        them went out through `forward`."""
        item = await self.queue.get()
        merging = self.forward is None
        while merging and not isinstance(item, BaseException) and not self.queue.empty():
            newer = self.queue.get_nowait()
            item = (
                newer if isinstance(newer, BaseException) else merge_outputs(item, newer, self.kind)
            )
        if isinstance(item, BaseException):
            raise item
        return item


class _Coalescing:
    """Which of one request's outputs to hand on when many requests stream at once.

    Every output handed on crosses the serving path (a frame entry, an SSE event, a
    client wake-up) at a CPU cost per message that, on a small CPU host, competes with
    the engine itself. So when the last step had outputs for more than
    `messages_per_step` requests, each hands on only every k-th of its outputs, k =
    ceil(outputs / messages_per_step), staggered across requests so each step sends
    about `messages_per_step` messages; its first output and its last always go out at
    once. With at most `messages_per_step` requests running (a single stream included)
    every output goes out. An output held back is merged into the next (`merge_outputs`:
    a cumulative one is contained in it, a delta is joined to it): no token is lost or
    repeated, and time per output token is unchanged; only the events of a busy stream
    carry several tokens each. 0 turns it off."""

    def __init__(self, messages_per_step: int, offset: int) -> None:
        self.messages_per_step = messages_per_step
        self.received = 0
        self.offset = offset

    def holds_back(self, finished: bool, outputs_per_step: int) -> bool:
        self.received += 1
        if finished or self.received == 1 or not self.messages_per_step:
            return False
        every = -(-outputs_per_step // self.messages_per_step)
        return (self.received + self.offset) % every != 0


def _put_all(items: list[tuple[_Stream, RequestOutput]], outputs_per_step: int) -> None:
    for stream, output in items:
        stream.take(output, outputs_per_step)


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine | Callable[[], LLMEngine],
        idle_poll_s: float = 0.5,
        messages_per_step: int = 0,
        supervision: Supervision = Supervision(),
    ) -> None:
        """Runs `engine` on its step thread, or the engine that function builds there
        (`AsyncEngine.build`): one built elsewhere makes the step thread a second OpenMP
        master beside the thread that built it, which costs CPU engines ~10% (see
        platform/compute_threads.py), so servers build on the step thread. Returns once
        the engine is ready, raising what building raised. `messages_per_step`: see
        `_Coalescing` (0: every request yields every step)."""
        make = engine if callable(engine) else lambda: engine
        self._start(make, idle_poll_s, messages_per_step, supervision)

    @classmethod
    def build(
        cls,
        config: EngineConfig,
        warm_up: bool = False,
        idle_poll_s: float = 0.5,
        messages_per_step: int = 0,
        supervision: Supervision = Supervision(),
    ) -> AsyncEngine:
        """Builds the engine (and warms it up) on the step thread itself, so one thread
        runs all of its compute; returns once it is ready, raising what building raised."""

        def make() -> LLMEngine:
            engine = LLMEngine(config)
            if warm_up:
                engine.warm_up()
            return engine

        return cls(make, idle_poll_s, messages_per_step, supervision)

    def _start(
        self,
        make: Callable[[], LLMEngine],
        idle_poll_s: float,
        messages_per_step: int,
        supervision: Supervision,
    ) -> None:
        if messages_per_step < 0:
            raise ValueError(f"messages_per_step must be >= 0, got {messages_per_step}")
        self._idle_poll_s = idle_poll_s
        self._messages_per_step = messages_per_step
        self._requests_started = 0
        self._commands: queue.SimpleQueue[_Add | _Abort | _Call] = queue.SimpleQueue()
        self._sleeping = False
        """Set from `sleep` until `wake_up` returns: generate() refuses new requests."""
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._stopping = threading.Event()
        self._supervision = supervision
        self._restart_times: list[float] = []
        self.last_step_time = time.monotonic()
        """When the loop last finished a turn (a step, or an idle wait)."""
        self._busy = False
        """True while a turn has work (requests queued or running)."""
        built = threading.Event()
        failure: list[BaseException] = []
        self._thread = threading.Thread(
            target=self._run, args=(make, built, failure), name="loraplex-engine", daemon=True
        )
        self._thread.start()
        built.wait()
        if failure:
            self._thread.join()
            raise failure[0]

    # ---- client side ---------------------------------------------------------------
    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        adapter: str | LoRAAdapter | None = None,
        cache_salt: str | None = None,
        tenant: str = "",
        tenant_weight: float = 1.0,
        embed: bool = False,
        forward: Callable[[RequestOutput], None] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs until it finishes, cumulative or deltas as
        `params.output_kind` says (`embed`: one output, the finished request with its
        `embedding`; see make_request_group). ValueError on bad input (an unknown or
        invalid adapter included); RequestFailedError when the engine ends the request
        early; EngineRestartedError / EngineDeadError when the engine restarts or dies
        under it. `adapter`: a registered name, an adapter folder or a loaded adapter;
        None runs the base model. `cache_salt`, `tenant` and `tenant_weight`: see
        make_request_group.

        `forward`: the iterator yields only the first output and the last; every output
        between them goes to `forward`, called on this event loop as the step's outputs
        arrive (no wake-up of the consumer per step). An exception it raises ends the
        request: the iterator raises it."""
        self.check_health()
        if self._sleeping:
            raise EngineAsleepError("the model is asleep (its memory is lent out); retry later")
        request_id = request_id or uuid.uuid4().hex
        lora = await self.load_adapter(adapter)
        grammar = None
        if params.guided is not None:
            grammar = await asyncio.to_thread(self.engine.compile_grammar, params.guided, tenant)
        group = self.engine.make_request_group(
            request_id,
            prompt,
            params,
            priority,
            lora=lora,
            cache_salt=cache_salt,
            grammar=grammar,
            tenant=tenant,
            tenant_weight=tenant_weight,
            embed=embed,
        )
        self._requests_started += 1
        coalescing = _Coalescing(self._messages_per_step, self._requests_started)
        stream = _Stream(asyncio.get_running_loop(), params.output_kind, coalescing, forward)
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
        self._send(_Add(group))
        finished = False
        try:
            while not finished:
                output = await stream.next()
                finished = output.finished
                if output.error is not None:
                    raise RequestFailedError(output.error)
                yield output
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self._send(_Abort(request_id))

    async def load_adapter(
        self,
        adapter: str | LoRAAdapter | None,
        name: str | None = None,
        root: Path | None = None,
        version: int | None = None,
        model_id: str | None = None,
    ) -> LoRAAdapter | None:
        """Loads an adapter (a registered name or a folder, labelled `name`) off the event
        loop and off the engine loop; `root`, `version` and `model_id` as in
        AdapterStore.load_async."""
        if adapter is None or isinstance(adapter, LoRAAdapter):
            return adapter
        future = self.engine.load_adapter_async(adapter, name, root, version, model_id)
        return await asyncio.wrap_future(future)

    def held_adapter(self, model_id: str) -> LoRAAdapter | None:
        """The host copy loaded under a catalog model id, if still held (LLMEngine)."""
        return self.engine.held_adapter(model_id)

    def held_adapter_ids(self) -> dict[str, bytes]:
        """Model id -> identity key of every host copy loaded under one (LLMEngine)."""
        return self.engine.held_adapter_ids()

    def on_adapter_evicted(self, listener: Callable[[str], None]) -> None:
        """`listener` hears the model id of each copy that leaves host memory."""
        self.engine.on_adapter_evicted(listener)

    def abort(self, request_id: str) -> None:
        self._send(_Abort(request_id))

    def check_health(self) -> None:
        """Raises EngineDeadError when the loop died or gave up, and EngineStalledError
        (failing every open stream) when a busy turn outlasts the step watchdog."""
        self._check_watchdog()
        if isinstance(self._error, EngineStalledError):
            raise EngineStalledError(str(self._error))
        if self._error is not None:
            raise EngineDeadError(f"engine loop died: {self._error!r}") from self._error
        if not self._thread.is_alive():
            raise EngineDeadError("engine loop is not running")
        try:
            self.engine.check_health()
        except RuntimeError as exc:
            raise EngineDeadError(str(exc)) from exc

    def _check_watchdog(self) -> None:
        limit = self._supervision.step_watchdog_s
        if limit is None or self._error is not None or not self._busy:
            return
        stalled_s = time.monotonic() - self.last_step_time
        if stalled_s <= limit:
            return
        error = EngineStalledError(
            f"the engine made no progress for {stalled_s:.0f} s with requests queued "
            f"(step watchdog: {limit:g} s); the replica is being replaced"
        )
        self._error = error
        logger.error("%s", error)
        self._fail_streams(error)

    def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Stops the loop, first letting in-flight requests finish for up to the timeout;
        streams still open then fail with EngineStoppedError."""
        deadline = time.monotonic() + drain_timeout_s
        while self._streams and time.monotonic() < deadline and self._error is None:
            time.sleep(0.05)
        self._stopping.set()
        self._wakeup.set()
        self._thread.join(timeout=10)
        self._drop_commands(EngineStoppedError("the model replica is shutting down"))
        if self._streams:
            logger.warning("engine stopping with %d request(s) still open", len(self._streams))
        self._fail_streams(EngineStoppedError("the model replica is shutting down; retry"))
        self.engine.shutdown()

    async def drain(self, timeout_s: float) -> None:
        """Waits (without blocking the event loop) until no request is open, at most
        `timeout_s`: a stopping replica lets its streams finish first."""
        deadline = time.monotonic() + timeout_s
        while self._streams and time.monotonic() < deadline and self._error is None:
            await asyncio.sleep(0.05)

    @property
    def asleep(self) -> bool:
        return self._sleeping

    async def sleep(self, drain_timeout_s: float) -> SleepReport:
        """Refuses new requests, waits up to `drain_timeout_s` for the open ones to
        finish, then sleeps the engine on its loop thread (LLMEngine.sleep). Requests
        still open at the deadline keep it awake: ValueError, and requests are taken
        again."""
        if self._sleeping:
            raise ValueError("the model is asleep already")
        self._sleeping = True
        try:
            await self.drain(drain_timeout_s)
            if self._streams:
                raise ValueError(
                    f"{len(self._streams)} request(s) still running after "
                    f"{drain_timeout_s:g} s; the model stays awake"
                )
            return await self._on_loop_thread(self.engine.sleep)
        except BaseException:
            self._sleeping = self.engine.asleep
            raise

    async def wake_up(self) -> SleepReport:
        """Wakes the engine on its loop thread (LLMEngine.wake_up); requests are taken
        again once it is awake. ValueError when awake."""
        if not self.engine.asleep:
            raise ValueError("the model is awake")
        report = await self._on_loop_thread(self.engine.wake_up)
        self._sleeping = False
        return report

    async def _on_loop_thread(self, work: Callable[[], SleepReport]) -> SleepReport:
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._send(_Call(work, done))
        return await asyncio.wrap_future(done)

    def _send(self, command: _Add | _Abort | _Call) -> None:
        self._commands.put(command)
        self._wakeup.set()

    # ---- what a model server reads -------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def limits(self) -> EngineLimits:
        """What the engine can hold (platform/request_limits.py)."""
        return self.engine.limits

    @property
    def arch(self) -> ModelArch:
        """The base model's shape (what an adapter must fit)."""
        return self.engine.arch

    def prompt_ids(
        self,
        prompt: str | Sequence[int] | None,
        messages: list[dict] | None = None,
        tools: list[dict] | None = None,
        lora: LoRAAdapter | None = None,
    ) -> list[int]:
        """A prompt's token ids: text or ids as given, or chat messages and the tools
        offered through the model's chat template (with the assistant's turn opened), in
        `lora`'s tokenizer where it has its own. Ids are checked when the request is made
        (`generate`)."""
        if messages is None:
            return self.engine.tokenize(prompt if prompt is not None else "", lora)
        return apply_chat_template(self.engine.tokenizer_for(lora), messages, tools=tools)

    @property
    def tool_call_format(self) -> str | None:
        """The tool-call format the model's chat template teaches (tool_call_format)."""
        return tool_call_format(self.engine.tokenizer)

    def token_ids(
        self,
        prompt: str | None,
        messages: list[dict] | None,
        add_special_tokens: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Text's token ids (with or without the tokenizer's special tokens), or chat
        messages' through the chat template; ValueError when they cannot be tokenized."""
        if messages is None:
            return encode_text(self.engine.tokenizer, prompt or "", add_special_tokens)
        return apply_chat_template(self.engine.tokenizer, messages, add_generation_prompt)

    def detokenize(self, token_ids: Sequence[int], lora: LoRAAdapter | None = None) -> str:
        """The text of `token_ids` (special tokens kept, in `lora`'s tokenizer where it
        has its own); ValueError for ids outside the vocabulary."""
        return self.engine.detokenize(token_ids, lora)

    def device_adapter_keys(self) -> set[bytes]:
        """Identity keys of the adapters now in the engine's LoRA slots."""
        return self.engine.device_adapter_keys()

    def stats(self) -> dict[str, float]:
        """The engine's gauges and counters (LLMEngine.stats)."""
        return self.engine.stats()

    def evict_adapter(self, folder: str | Path, version: int | None) -> None:
        """Drops an adapter's host copy (a no-op when LoRA is off or it is not held)."""
        self.engine.evict_adapter(folder, version)

    def snapshot(self) -> EngineSnapshot:
        """What the engine holds now, with the streams open on it (tests, debugging, the
        replica's info endpoint)."""
        return dataclasses.replace(self.engine.snapshot(), streams=len(self._streams))

    # ---- loop thread -------------------------------------------------------------------
    def _run(
        self, make: Callable[[], LLMEngine], built: threading.Event, failure: list[BaseException]
    ) -> None:
        name_this_thread(COMPUTE_THREAD_NAME)  # before the first parallel region
        try:
            self.engine = make()
            self.engine.enter_compute_thread()
        except BaseException as exc:
            failure.append(exc)
            return
        finally:
            built.set()
        while not self._stopping.is_set():
            try:
                self._turn()
            except Exception as exc:
                if not self._restart(exc):
                    return
            except BaseException as exc:
                self._die(exc)
                return

    def _turn(self) -> None:
        """One loop turn: apply queued adds and aborts, then step (or idle)."""
        self._apply_commands()
        if not self.engine.has_unfinished():
            self._busy = False
            self._wakeup.wait(self._idle_poll_s)
            self._wakeup.clear()
            self.last_step_time = time.monotonic()
            return
        self._busy = True
        self._deliver_step(self.engine.step())
        self.last_step_time = time.monotonic()

    def _restart(self, exc: Exception) -> bool:
        """Fails the in-flight requests and resets the engine; False (the loop died)
        when the engine cannot be reset."""
        logger.error("engine step failed, restarting the engine in place", exc_info=exc)
        self._drop_commands()
        try:
            self.engine.reset()
        except Exception as reset_error:
            logger.exception("engine reset failed")
            self._die(reset_error)
            return False
        now = time.monotonic()
        window = self._supervision.restart_window_s
        self._restart_times = [t for t in self._restart_times if t > now - window]
        self._restart_times.append(now)
        if len(self._restart_times) > self._supervision.max_restarts:
            self._die(
                RuntimeError(
                    f"the engine failed {len(self._restart_times)} times within {window:g} s "
                    f"(last: {exc!r}); giving up so that the replica is replaced"
                )
            )
            return False
        self._fail_streams(EngineRestartedError(f"the engine restarted after an error: {exc!r}"))
        logger.warning(
            "engine restarted in place (%d restart(s) in the last %.0fs)",
            len(self._restart_times),
            window,
        )
        self.last_step_time = time.monotonic()
        return True

    def _die(self, exc: BaseException) -> None:
        self._error = exc
        logger.error("engine loop died", exc_info=exc)
        self._drop_commands(EngineDeadError(f"engine loop died: {exc!r}"))
        self._fail_streams(EngineDeadError(f"engine loop died: {exc!r}"))

    def _fail_streams(self, error: BaseException) -> None:
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.put(error)

    def _drop_commands(self, error: BaseException | None = None) -> None:
        """Forgets queued adds and aborts (their streams are failed next); a queued call
        fails with `error`."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Call):
                command.done.set_exception(
                    error or EngineRestartedError("the engine restarted before the call ran")
                )

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
            elif isinstance(command, _Call):
                try:
                    command.done.set_result(command.work())
                except BaseException as exc:
                    command.done.set_exception(exc)
            else:
                output = self.engine.abort_request(command.request_id)
                if output is not None:
                    self._deliver(command.request_id, output)
                    logger.info("request %s aborted", command.request_id)

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs reach their streams in one callback per event loop (not one
        wake-up per request): the consumers' loop and this thread share one GIL."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        with self._lock:
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream, output))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items, len(outputs))

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(item)
