"""ModelServer: one Ray Serve deployment per base model; each replica owns one AsyncEngine.

Its jobs:
- build the engine from a validated `ModelDeploymentConfig` (model, engine options) and
  warm it up before the replica reports ready, so the first burst is served warm;
- turn a `GenerateCall` (prompt text, token ids or chat messages + sampling params)
  into a stream of `StreamDelta`s: per completion, only what is new since the last one;
  after the first step, in one frame per engine step to each ingress replica over its
  frame channel (frame_outbox.py) when the call names one;
- run the call on the LoRA adapter named by the Serve multiplexed model id (see
  catalog.py): the engine's adapter store is the replica's one host LRU (up to
  `max_cpu_loras` adapters), its copies labelled with their model ids, so a request for
  a held adapter needs no catalog read; the router learns which replica holds which
  from `record_routing_stats`; an adapter the store evicts leaves the replica's
  per-adapter request counts too (no per-model-id state outlives it);
- report bad input as a `GenerateError` (the ingress maps it to a 4xx) instead of
  raising, so nothing a client sends fails the replica: that includes a request that
  alone needs more tokens than its tenant's budget or the KV cache, and a request the
  engine ended early (its adapter produced NaN: 400; an internal error of that request
  alone: 500), while the rest of the batch runs on; a step failure that restarted the
  engine in place is a 503 with Retry-After for the requests it dropped;
- tell the ingress what an adapter must fit (`adapter_shape`: the ingress validates
  registrations itself, off this replica's request path);
- load tenant adapters under their owner's root without following links, one copy per
  catalog version (an unload forces a fresh read);
- keep each tenant's prefix-cache entries apart (`GenerateCall.cache_salt`);
- refuse, with 503 + Retry-After, a request it could not start within
  `admission_max_wait_s` of its arrival at the ingress (admission.py), so that under
  overload the admitted requests are answered in time instead of all of them late;
- arm failpoints (platform/failpoints.py) when the config allows fault injection;
- record engine and request metrics (metrics.py);
- publish where its adapters sit to the app's residency registry (residency.py), and
  warm a newly registered adapter when the ingress asks (`prefetch_adapter`);
- fail `check_health` when the engine loop is dead, gave up after too many restarts
  (`max_engine_restarts`) or stalled (`step_watchdog_s`), so Serve replaces the replica;
- on shutdown (Serve first drains the requests in flight for
  `graceful_shutdown_timeout_s`), stop the engine, which fails what is still open.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from loraplex.adapters.peft_format import LoRAAdapter
from loraplex.deployments.adapter_validation import AdapterShape
from loraplex.deployments.admission import AdmissionControl
from loraplex.deployments.autoscaling import ADAPTERS_IN_DEMAND, HOST_ADAPTER_CAPACITY
from loraplex.deployments.catalog import AdapterCatalog, AdapterEntry
from loraplex.deployments.config import ModelDeploymentConfig, model_deployment_name
from loraplex.deployments.frame_outbox import FrameOutboxes
from loraplex.deployments.logprobs import TokenTexts
from loraplex.deployments.logs import PER_REQUEST, send_platform_logs_to_serve
from loraplex.deployments.metrics import EngineMetrics, ProcessMemory
from loraplex.deployments.residency import HEARTBEAT_S, PUBLISH_PERIOD_S, ReplicaResidency
from loraplex.deployments.step_frames import CALL_END
from loraplex.deployments.wire import (
    ADAPTER_REPLACED,
    GenerateCall,
    GenerateError,
    StreamDelta,
    StreamStep,
)
from loraplex.platform.async_engine import (
    AsyncEngine,
    EngineAsleepError,
    EngineDeadError,
    EngineRestartedError,
    EngineStoppedError,
    RequestFailedError,
    Supervision,
)
from loraplex.platform.failpoints import FAILPOINTS
from loraplex.platform.request import DELTA, RequestOutput
from loraplex.platform.request_limits import fit_embedding, fit_request

logger = logging.getLogger(__name__)
STATS_PERIOD_S = 2.0
OVERLOADED = "overloaded"


class AdapterReplacedError(LookupError):
    """The call's adapter version is no longer in the catalog and not held here."""


RETRY_ELSEWHERE_S = 2
"""Retry-After of a request that a dead, stalled or stopping replica ended."""
ASLEEP = "model_asleep"
"""GenerateError code: the replica sleeps (an operator lent its memory out)."""
ASLEEP_RETRY_AFTER_S = 5
SLEEP_DRAIN_S = 20.0
"""How long a replica told to sleep waits for its open requests (the ingress waits
ADMIN_CALL_S, 30 s, for every replica's answer)."""


class AdapterRequests:
    """This replica's requests per multiplexed model id since it started ('' is the base
    model), and the time of each adapter's latest request.

    Every register or unload mints a new model id (catalog.py), so no entry may outlive
    its use: an adapter's count lasts while this replica holds it (`evicted` drops it
    when the engine's adapter store evicts the adapter; loaded again, it counts from
    zero, which the registry reads as a restart), and its latest request time lasts
    `demand_window_s` (an adapter evicted but still requested is what the autoscaler
    counts as demand over capacity). `forget` drops both for an adapter whose load
    failed. The base model's '' stays. The store evicts on its load threads, hence the
    lock."""

    def __init__(self, demand_window_s: float) -> None:
        self._window_s = demand_window_s
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._last_request: dict[str, float] = {}
        self._pruned_at = -math.inf

    def record(self, model_id: str, now: float) -> None:
        """One request for `model_id` at monotonic time `now`; request times older than
        the window are dropped once per window."""
        with self._lock:
            self._counts[model_id] += 1
            if model_id:
                self._last_request[model_id] = now
            if now - self._pruned_at >= self._window_s:
                self._prune(now)

    def evicted(self, model_id: str) -> None:
        """The replica no longer holds the adapter: its count goes."""
        if model_id:
            with self._lock:
                self._counts.pop(model_id, None)

    def forget(self, model_id: str) -> None:
        """The adapter never loaded: its count and request time go."""
        if model_id:
            with self._lock:
                self._counts.pop(model_id, None)
                self._last_request.pop(model_id, None)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def in_demand(self, now: float) -> list[str]:
        """The adapters requested within the window before `now`."""
        with self._lock:
            self._prune(now)
            return sorted(self._last_request)

    def _prune(self, now: float) -> None:
        since = now - self._window_s
        self._last_request = {m: t for m, t in self._last_request.items() if t >= since}
        self._pruned_at = now


def _pinned_version(entry: AdapterEntry) -> int | None:
    """Tenant adapters are pinned per catalog version; shared ones follow their files."""
    return entry.version if entry.root is not None else None


class ReplicaPlace:
    """Where a ModelServer runs, as Serve tells it: its replica id, its node, and the
    multiplexed model id (the adapter) of the call being handled."""

    def replica_id(self) -> str:
        return serve.get_replica_context().replica_id.unique_id

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def multiplexed_model_id(self) -> str:
        return serve.get_multiplexed_model_id()


class LocalPlace(ReplicaPlace):
    """A ModelServer built outside Serve (in a test's process): one local replica whose
    calls name no adapter."""

    def replica_id(self) -> str:
        return "local"

    def node_id(self) -> str:
        return ""

    def multiplexed_model_id(self) -> str:
        return ""


class ModelServer:
    def __init__(
        self,
        config: ModelDeploymentConfig,
        adapter_root: str,
        registry: DeploymentHandle | None = None,
        place: ReplicaPlace | None = None,
    ) -> None:
        """`place`: where it runs (default: the Serve replica it is; `LocalPlace` off
        Serve)."""
        send_platform_logs_to_serve()
        self.place = place if place is not None else ReplicaPlace()
        constructed = time.perf_counter()
        self.config = config
        engine_config = config.engine_config()
        self.engine = AsyncEngine.build(
            engine_config,
            warm_up=True,
            messages_per_step=config.stream_messages_per_step,
            supervision=Supervision(
                max_restarts=config.max_engine_restarts,
                restart_window_s=config.engine_restart_window_s,
                step_watchdog_s=config.step_watchdog_s,
            ),
        )
        self.token_texts = TokenTexts(self.engine.detokenize)
        self.catalog = AdapterCatalog(adapter_root, {config.name: dict(config.adapters)})
        replica = self.place.replica_id()
        self.replica_id = replica
        self.metrics = EngineMetrics(config.name, replica)
        self.outboxes = FrameOutboxes(replica, self.place.node_id())
        self.memory = ProcessMemory(model_deployment_name(config.name), replica)
        self.admission = AdmissionControl(
            config.admission_max_wait_s,
            engine_config.scheduler.max_num_seqs,
            fair=engine_config.scheduler.policy == "fair",
        )

        self._host_adapter_capacity = engine_config.lora.max_cpu_loras
        self._requests = AdapterRequests(config.server.adapter_demand_window_s)
        self.engine.on_adapter_evicted(self._requests.evicted)
        self._stop = threading.Event()
        self._reporter = threading.Thread(target=self._report_stats, daemon=True)
        self._reporter.start()
        self._registry = registry
        if registry is not None:
            threading.Thread(target=self._publish_residency, daemon=True).start()
        logger.info(
            "model server for %s ready (replica %s): cold start %.1f s (engine build, "
            "weights, warm-up)",
            config.name,
            replica,
            time.perf_counter() - constructed,
        )

    async def _adapter(self, model_id: str) -> LoRAAdapter:
        """The adapter `model_id` names: the engine's host copy while it holds one, else
        its catalog entry loaded into the engine's host tier under that id."""
        held = self.engine.held_adapter(model_id)
        if held is not None:
            return held
        entry = self.catalog.by_model_id(self.config.name, model_id)
        if entry is None:
            raise AdapterReplacedError(
                f"adapter {model_id!r} is not in the catalog (deleted or replaced)"
            )
        started = time.perf_counter()
        try:
            adapter = await self.engine.load_adapter(
                str(entry.folder), entry.public_id, entry.root, _pinned_version(entry), model_id
            )
        except Exception:
            self.metrics.adapter_loads.inc(1, {**self.metrics.tags, "result": "error"})
            raise
        self.metrics.adapter_loads.inc(1, {**self.metrics.tags, "result": "ok"})
        self.metrics.adapter_load.observe(time.perf_counter() - started, self.metrics.tags)
        return adapter

    async def _adapter_for_call(self) -> LoRAAdapter | None:
        """The call's adapter, counted as one request for it; a failed load (not in the
        catalog, bad files, the call cancelled) of an adapter this replica does not hold
        forgets it, so an id that never loads leaves no entry behind."""
        model_id = self.place.multiplexed_model_id()
        self._requests.record(model_id, time.monotonic())
        if not model_id:
            return None
        try:
            return await self._adapter(model_id)
        except BaseException:
            if model_id not in self.engine.held_adapter_ids():
                self._requests.forget(model_id)
            raise

    async def prefetch_adapter(self) -> bool:
        """Loads the adapter named by the call's multiplexed model id into this replica's
        host tier ahead of its first request (the ingress sends one call when a tenant
        registers an adapter). Off the engine loop like every load, so it never holds up
        other requests. False when the adapter is gone by then (deleted or replaced)."""
        return await self._load_ahead("prefetch")

    async def replicate_adapter(self) -> bool:
        """As `prefetch_adapter`, for a hot adapter: the registry's replicator
        (deployments/replication.py) sends it to a replica that lacks the adapter, ahead
        of the requests the router will then spread here."""
        return await self._load_ahead("replication")

    async def _load_ahead(self, purpose: str) -> bool:
        model_id = self.place.multiplexed_model_id()
        try:
            await self._adapter(model_id)
        except LookupError as exc:
            logger.info("%s of %s skipped: %s", purpose, model_id, exc)
            return False
        logger.info("adapter %s loaded into host memory (%s)", model_id, purpose)
        return True

    def adapter_shape(self) -> AdapterShape:
        """What an adapter must fit on this base model; the ingress validates
        registrations against it in its own process (adapter_validation.py)."""
        lora = self.config.engine_config().lora
        return AdapterShape(
            self.engine.arch, lora.max_lora_rank, lora.max_loras > 0, lora.max_adapter_vocab_size
        )

    def arm_failpoint(
        self,
        name: str,
        prompt: list[int] | None = None,
        times: int | None = None,
        delay_s: float = 0.0,
        replica: str | None = None,
    ) -> str | None:
        """Arms a failpoint in this replica's engine (platform/failpoints.py); refused
        unless the deployment's config sets `fault_injection: true`. `replica`: the
        unique id of the replica meant (the router pins the call there); returns this
        replica's id when armed, None when it is not the one meant."""
        if not self.config.fault_injection:
            raise PermissionError("fault injection is off for this deployment")
        if replica is not None and replica != self.replica_id:
            return None
        FAILPOINTS.arm(name, prompt, times, delay_s)
        logger.warning("failpoint %s armed on replica %s", name, self.replica_id)
        return self.replica_id

    async def sleep(self, replica: str | None = None) -> dict | None:
        """Operator: lets this replica's open requests finish (up to SLEEP_DRAIN_S;
        ValueError when some are still open then), then releases its KV cache and, on
        a GPU, moves its weights to host memory (platform/sleep_mode.py); requests get
        503 `model_asleep` until `wake_up`. `replica` as in `arm_failpoint`; returns
        what moved and how long it took."""
        if replica is not None and replica != self.replica_id:
            return None
        if self.engine.asleep:
            return {"replica": self.replica_id, "asleep_already": True}
        report = await self.engine.sleep(SLEEP_DRAIN_S)
        logger.warning("replica %s asleep: %s", self.replica_id, report.as_dict())
        return {"replica": self.replica_id, **report.as_dict()}

    async def wake_up(self, replica: str | None = None) -> dict | None:
        """Operator: undoes `sleep`; as `sleep` returns. Both answer at once when the
        replica is in that state already, so an operator's retry converges."""
        if replica is not None and replica != self.replica_id:
            return None
        if not self.engine.asleep:
            return {"replica": self.replica_id, "awake_already": True}
        report = await self.engine.wake_up()
        logger.warning("replica %s awake: %s", self.replica_id, report.as_dict())
        return {"replica": self.replica_id, **report.as_dict()}

    def disarm_failpoints(self, replica: str | None = None) -> str | None:
        """Disarms every failpoint of this replica (`replica` as in `arm_failpoint`)."""
        if replica is not None and replica != self.replica_id:
            return None
        FAILPOINTS.disarm()
        return self.replica_id

    def _report_stats(self) -> None:
        while not self._stop.wait(STATS_PERIOD_S):
            try:
                self.metrics.record_engine(self.engine.stats())
            except Exception:
                logger.exception("recording engine metrics failed")

    def residency(self) -> ReplicaResidency:
        """This replica's adapters by tier, as the residency registry keeps them."""
        stats = self.record_routing_stats()
        return ReplicaResidency(
            model=self.config.name,
            replica=self.metrics.tags["replica"],
            node_id=self.place.node_id(),
            device=stats["device"],
            host=stats["host"],
            requests=self._requests.counts(),
        )

    def _publish_residency(self) -> None:
        """Sends this replica's residency to the registry when its tiers changed, and
        every HEARTBEAT_S anyway with the request counts as they are then (counts move
        with every request: sending them each period would be a registry call per
        period under load)."""
        failures, last, sent_at = 0, None, 0.0
        while not self._stop.wait(PUBLISH_PERIOD_S):
            try:
                report = self.residency()
                same_tiers = last is not None and (report.device, report.host) == (
                    last.device,
                    last.host,
                )
                if same_tiers and time.monotonic() - sent_at < HEARTBEAT_S:
                    continue
                self._registry.publish.remote(report).result(timeout_s=10)
                last, sent_at, failures = report, time.monotonic(), 0
            except Exception as exc:
                failures += 1
                if failures in (1, 10) or failures % 100 == 0:
                    logger.warning("publishing residency failed (%d in a row): %r", failures, exc)

    def record_routing_stats(self) -> dict[str, Any]:
        """Where this replica's adapters sit, for the request router
        (deployments/request_router.py; Serve polls it every `ROUTING_STATS_PERIOD_S`):
        the multiplexed model ids in device slots and in host memory. Only what the
        router reads: Serve's controller broadcasts the stats to every router whenever
        they change, so a count that moves with each request (the residency report's
        `requests`) would cost a broadcast per period under load."""
        in_slots = self.engine.device_adapter_keys()
        resident = self.engine.held_adapter_ids()
        return {
            "device": sorted(m for m, key in resident.items() if key in in_slots),
            "host": sorted(resident),
        }

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics (deployments/autoscaling.py): the distinct
        adapters this replica served within `server.adapter_demand_window_s`, and how
        many it holds in host memory."""
        return {
            ADAPTERS_IN_DEMAND: float(len(self._requests.in_demand(time.monotonic()))),
            HOST_ADAPTER_CAPACITY: float(self._host_adapter_capacity),
        }

    def replica_info(self, replica: str | None = None) -> dict | None:
        """This replica's id, its adapters by tier with the requests it served per model
        id (`residency`), and its engine state (tests, debugging). `replica` as in
        `arm_failpoint`: None when this is not the replica meant."""
        if replica is not None and replica != self.replica_id:
            return None
        snapshot = self.engine.snapshot()
        residency = self.residency()
        return {
            "replica": self.metrics.tags["replica"],
            "resident_model_ids": residency.host,
            "device": residency.device,
            "host": residency.host,
            "requests": residency.requests,
            "pid": os.getpid(),
            "admission_refused": self.admission.refused,
            **dataclasses.asdict(snapshot),
        }

    async def generate(self, call: GenerateCall) -> AsyncIterator[StreamStep | GenerateError]:
        """Streams StreamSteps; a GenerateError is the only item when the input is bad.
        A call with `frames_to` gets its first item here, naming this replica, and every
        later one in its ingress's frames (deployments/frame_outbox.py), while this
        stream stays open until the request ends."""
        outbox = None
        if call.frames_to is not None:
            outbox = await self.outboxes.open(call.frames_to)
        if outbox is None:
            async for item in self._steps(call):
                yield item
            return

        def forward(step: StreamStep | GenerateError) -> None:
            if not outbox.put(call.frame_key, step):
                raise FrameChannelClosed(call.request_id)

        first = True
        try:
            async for item in self._steps(call, forward):
                if first:
                    first = False
                    if isinstance(item, StreamStep):
                        item = dataclasses.replace(item, replica=self.replica_id)
                    yield item
                else:
                    forward(item)
            if not first:
                outbox.put(call.frame_key, CALL_END)
        except FrameChannelClosed:
            logger.warning("request %s: its frame channel closed", call.request_id)
            yield GenerateError(
                503, "the model replica lost its channel to the ingress; retry", retry_after_s=1
            )
        finally:
            outbox.call_ended()

    async def _steps(
        self, call: GenerateCall, forward: Callable[[StreamStep], None] | None = None
    ) -> AsyncIterator[StreamStep | GenerateError]:
        """The call's steps; with `forward`, only its first and last come out here, and
        every step between them goes to `forward` as the engine produces it (on this
        event loop, AsyncEngine.generate)."""
        started = time.perf_counter()
        waited_s = time.time() - call.received_at if call.received_at is not None else 0.0
        refusal = self.admission.admit(
            call.request_id, call.params.n, waited_s, call.tenant, call.tenant_weight
        )
        if refusal is not None:
            logger.info(
                "request %s refused: %s", call.request_id, refusal.message, extra=PER_REQUEST
            )
            self.metrics.refused.inc(1, self.metrics.tags)
            yield GenerateError(
                503, refusal.message, retry_after_s=refusal.retry_after_s, code=OVERLOADED
            )
            return
        builder = StepBuilder(
            self.token_texts, started, functools.partial(self.admission.started, call.request_id)
        )
        try:
            lora = await self._adapter_for_call()
            if lora is not None and lora.tokenizer is not None:
                builder.texts = TokenTexts(functools.partial(self.engine.detokenize, lora=lora))
            prompt = self.engine.prompt_ids(call.prompt, call.messages, call.tools, lora)
            if call.embed:
                fitted = fit_embedding(len(prompt), self.engine.limits, call.max_request_tokens)
            else:
                fitted = fit_request(
                    len(prompt),
                    call.params,
                    self.engine.limits,
                    "requested" if call.max_tokens_given else "default",
                    call.max_request_tokens,
                )
            builder.worst_case_tokens = fitted.worst_case_tokens
            stream = self.engine.generate(
                prompt,
                dataclasses.replace(fitted.params, output_kind=DELTA),
                request_id=call.request_id,
                adapter=lora,
                cache_salt=call.cache_salt,
                tenant=call.tenant,
                tenant_weight=call.tenant_weight,
                embed=call.embed,
                forward=None if forward is None else lambda output: forward(builder.step(output)),
            )
            if call.embed:
                step = await _embedding_step(stream)
                builder.prompt_tokens = step.prompt_tokens
                yield step
            else:
                echo_text = self._prompt_text(call.prompt, prompt, lora) if call.echo else None
                tool_format = self.engine.tool_call_format if call.tools else None
                first = True
                async for output in stream:
                    step = builder.step(output)
                    if first:
                        step = dataclasses.replace(
                            step, echo_text=echo_text, tool_call_format=tool_format
                        )
                        first = False
                    yield step
        except AdapterReplacedError as exc:
            logger.info("request %s: %s", call.request_id, exc, extra=PER_REQUEST)
            yield GenerateError(404, str(exc), code=ADAPTER_REPLACED)
            return
        except (ValueError, LookupError) as exc:
            logger.info("request %s rejected: %s", call.request_id, exc, extra=PER_REQUEST)
            yield GenerateError(404 if isinstance(exc, LookupError) else 400, str(exc))
            return
        except RequestFailedError as exc:
            logger.warning("request %s failed in the engine: %s", call.request_id, exc)
            yield GenerateError(400 if exc.failure.client_fault else 500, str(exc))
            return
        except EngineRestartedError as exc:
            logger.warning("request %s dropped by an engine restart", call.request_id)
            yield GenerateError(503, f"{exc}; retry", retry_after_s=1)
            return
        except EngineAsleepError as exc:
            logger.info("request %s refused: %s", call.request_id, exc, extra=PER_REQUEST)
            yield GenerateError(503, str(exc), retry_after_s=ASLEEP_RETRY_AFTER_S, code=ASLEEP)
            return
        except (EngineDeadError, EngineStoppedError) as exc:
            logger.warning("request %s ended: %s", call.request_id, exc)
            yield GenerateError(
                503,
                f"model {self.config.name!r} replica is unavailable ({exc}); retry",
                retry_after_s=RETRY_ELSEWHERE_S,
            )
            return
        finally:
            self.admission.finish(call.request_id)
        elapsed = time.perf_counter() - started
        self.metrics.record_request(
            call.adapter, builder.prompt_tokens, builder.num_tokens, builder.first_token_s, elapsed
        )
        logger.info(
            "request %s done: tenant=%s adapter=%s prompt=%d generated=%d in %.2fs",
            call.request_id,
            call.tenant or "-",
            call.adapter or "-",
            builder.prompt_tokens,
            builder.num_tokens,
            elapsed,
            extra=PER_REQUEST,
        )

    def _prompt_text(
        self, prompt: str | list[int] | None, ids: list[int], lora: LoRAAdapter | None
    ) -> str:
        if isinstance(prompt, str):
            return prompt
        return self.engine.detokenize(ids, lora)

    def tokenize(
        self,
        prompt: str | None,
        messages: list[dict[str, Any]] | None,
        add_special_tokens: bool,
        add_generation_prompt: bool,
    ) -> dict | GenerateError:
        """/v1/tokenize: the token ids of a prompt or of chat messages (through the chat
        template); a GenerateError (400) when the tokenizer or template refuses them."""
        try:
            ids = self.engine.token_ids(prompt, messages, add_special_tokens, add_generation_prompt)
        except ValueError as exc:
            return GenerateError(400, str(exc))
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids}

    def detokenize(self, tokens: list[int]) -> dict | GenerateError:
        """/v1/detokenize: the text of token ids; 400 for ids outside the vocabulary."""
        try:
            return {"prompt": self.engine.detokenize(tokens)}
        except ValueError as exc:
            return GenerateError(400, str(exc), param="tokens")

    def check_health(self) -> None:
        self.engine.check_health()

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
        registry = getattr(self, "_registry", None)
        if registry is not None:
            try:
                registry.withdraw.remote(self.config.name, self.metrics.tags["replica"])
            except Exception:
                logger.debug("withdrawing from the residency registry failed", exc_info=True)
        memory = getattr(self, "memory", None)
        if memory is not None:
            memory.stop()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


async def _embedding_step(stream: AsyncIterator[RequestOutput]) -> StreamStep:
    """An embed call's one step: its prompt's embedding, once the engine finished it."""
    last = None
    async for output in stream:
        last = output
    if last is None or last.embedding is None:
        raise RuntimeError("the embedding request ended without its embedding")
    prompt_tokens = len(last.prompt_token_ids)
    return StreamStep(
        prompt_tokens,
        [],
        worst_case_tokens=prompt_tokens,
        cached_tokens=last.num_cached_tokens,
        embedding=last.embedding,
    )


class FrameChannelClosed(RuntimeError):
    """A framed call's step could not be queued: its ingress's channel closed."""


class StepBuilder:
    """Turns a DELTA request's outputs (platform/request.py RequestOutput) into the
    wire's StreamSteps, counting what the call generated. When the first generated token
    arrives it records `first_token_s` (seconds since `started`, a perf_counter time) and
    runs `on_first_token` once."""

    def __init__(
        self, texts: TokenTexts, started: float, on_first_token: Callable[[], None]
    ) -> None:
        self.texts = texts
        self.worst_case_tokens = 0
        self.prompt_tokens = 0
        self.num_tokens = 0
        """Tokens generated so far over every completion."""
        self.first_token_s: float | None = None
        self._started = started
        self._on_first_token = on_first_token

    def step(self, output: RequestOutput) -> StreamStep:
        deltas = []
        new_tokens = 0
        for completion in output.outputs:
            count = len(completion.token_ids)
            new_tokens += count
            entries = self.texts.entries(completion.logprobs) if completion.logprobs else []
            deltas.append(
                StreamDelta(
                    completion.index, completion.text, count, completion.finish_reason, entries
                )
            )
        if new_tokens and not self.num_tokens:
            self.first_token_s = time.perf_counter() - self._started
            self._on_first_token()
        self.num_tokens += new_tokens
        self.prompt_tokens = len(output.prompt_token_ids)
        prompt_logprobs = None
        if output.prompt_logprobs is not None:
            prompt = output.prompt_token_ids
            prompt_logprobs = self.texts.prompt_entries(prompt, output.prompt_logprobs)
        return StreamStep(
            self.prompt_tokens,
            deltas,
            self.worst_case_tokens,
            output.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
        )
