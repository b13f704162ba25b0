"""ModelServer: one Ray Serve deployment per base model; each replica owns one AsyncEngine.

Its jobs:
- build the engine from a validated `ModelDeploymentConfig` (model, engine options);
- turn a `GenerateCall` (prompt text, token ids or chat messages + sampling params)
  into a stream of `StreamDelta`s: per completion, only what is new since the last one;
- run the call on the LoRA adapter named by the Serve multiplexed model id (see
  catalog.py): `serve.multiplexed` keeps up to `max_cpu_loras` adapters resident per
  replica and tells Serve's router which replica holds which, so an adapter's requests
  land where it is loaded; an adapter evicted there leaves the engine's host store too;
- report bad input as a `GenerateError` (the ingress maps it to a 4xx) instead of
  raising, so nothing a client sends fails the replica;
- record engine and request metrics (metrics.py);
- fail `check_health` when the engine loop is dead, so Serve replaces the replica;
- drain in-flight requests on shutdown.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ray import serve

from loraplex.adapters.peft_format import LoRAAdapter
from loraplex.adapters.store import AdapterStore
from loraplex.deployments.catalog import AdapterCatalog, AdapterEntry
from loraplex.deployments.config import ModelDeploymentConfig
from loraplex.deployments.metrics import EngineMetrics
from loraplex.platform.async_engine import AsyncEngine
from loraplex.platform.engine import LLMEngine
from loraplex.platform.request import Logprob, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)
STATS_PERIOD_S = 2.0


@dataclass(frozen=True)
class GenerateCall:
    """One request as the ingress forwards it; the adapter travels as the Serve
    multiplexed model id (`AdapterEntry.model_id`), "" for the base model."""

    request_id: str
    params: SamplingParams
    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] | None = None
    tenant: str = ""
    adapter: str | None = None
    """Public adapter id ('base:name') for logs and metrics."""
    max_tokens_given: bool = True
    """False: `params.max_tokens` is a default, shortened to what the context has room
    for. True: a request that cannot fit it is refused (400)."""


@dataclass(frozen=True)
class StreamDelta:
    """What one completion gained since the previous delta."""

    index: int
    text: str
    num_new_tokens: int
    finish_reason: str | None
    logprobs: list[Logprob] = field(default_factory=list)


@dataclass(frozen=True)
class StreamStep:
    prompt_tokens: int
    deltas: list[StreamDelta]


@dataclass(frozen=True)
class GenerateError:
    status: int
    message: str
    param: str | None = None


class ResidentAdapter:
    """What `serve.multiplexed` caches per adapter: its catalog entry. When Serve
    evicts it (LRU past `max_num_models_per_replica`) the engine drops its host copy."""

    def __init__(self, entry: AdapterEntry, store: AdapterStore, resident_ids: set[str]) -> None:
        self.entry = entry
        self._store = store
        self._resident_ids = resident_ids
        resident_ids.add(entry.model_id)

    def __del__(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            store.evict(self.entry.folder)
            self._resident_ids.discard(self.entry.model_id)


class ModelServer:
    def __init__(self, config: ModelDeploymentConfig, adapter_root: str) -> None:
        self.config = config
        engine_config = config.engine_config()
        self.engine = AsyncEngine(LLMEngine(engine_config))
        self.catalog = AdapterCatalog(adapter_root, {config.name: dict(config.adapters)})
        replica = serve.get_replica_context().replica_id.unique_id if _in_serve() else "local"
        self.metrics = EngineMetrics(config.name, replica)

        # A plain function, not the bound method: Serve caches its state on the callable.
        async def load_resident(model_id: str) -> ResidentAdapter:
            return await self._load_resident(model_id)

        self._resident = serve.multiplexed(
            max_num_models_per_replica=max(engine_config.lora.max_cpu_loras, 1)
        )(load_resident)
        self._resident_ids: set[str] = set()
        self._stop = threading.Event()
        self._reporter = threading.Thread(target=self._report_stats, daemon=True)
        self._reporter.start()
        logger.info("model server for %s ready (replica %s)", config.name, replica)

    async def _load_resident(self, model_id: str) -> ResidentAdapter:
        """serve.multiplexed's loader: catalog entry of `model_id`, loaded into the engine."""
        entry = self.catalog.by_model_id(self.config.name, model_id)
        if entry is None:
            raise LookupError(f"adapter {model_id!r} is not in the catalog (deleted or replaced)")
        started = time.perf_counter()
        await self.engine.load_adapter(str(entry.folder), entry.public_id)
        self.metrics.adapter_load.observe(time.perf_counter() - started, self.metrics.tags)
        return ResidentAdapter(entry, self.engine.engine.adapters, self._resident_ids)

    async def _adapter_for_call(self) -> LoRAAdapter | None:
        model_id = serve.get_multiplexed_model_id() if _in_serve() else ""
        if not model_id:
            return None
        resident = await self._resident(model_id)
        entry = resident.entry
        # A cache hit unless the files changed on disk since (then a reload, new identity).
        return await self.engine.load_adapter(str(entry.folder), entry.public_id)

    async def validate_adapter(self, folder: str, name: str) -> GenerateError | None:
        """Loads and validates an adapter folder against this base model (admin API)."""
        try:
            await self.engine.load_adapter(folder, name)
        except ValueError as exc:
            return GenerateError(400, str(exc))
        return None

    def _report_stats(self) -> None:
        while not self._stop.wait(STATS_PERIOD_S):
            try:
                self.metrics.record_engine(self.engine.engine.stats())
            except Exception:
                logger.exception("recording engine metrics failed")

    def _prompt_ids(self, call: GenerateCall) -> list[int]:
        engine = self.engine.engine
        if call.messages is None:
            return engine.tokenize(call.prompt)
        encoded = engine.tokenizer.apply_chat_template(
            call.messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return list(encoded["input_ids"])

    def _fit_max_tokens(self, call: GenerateCall, num_prompt_tokens: int) -> SamplingParams:
        """Sampling params whose max_tokens fits the context (see `max_tokens_given`)."""
        limit = self.engine.engine.max_model_len
        room = limit - num_prompt_tokens
        params = call.params
        if params.max_tokens <= room or room < 1:
            return params
        if call.max_tokens_given:
            raise ValueError(
                f"this model's maximum context length is {limit} tokens, but {num_prompt_tokens}"
                f" prompt tokens + max_tokens {params.max_tokens} were requested"
            )
        return dataclasses.replace(params, max_tokens=room)

    def replica_info(self) -> dict:
        """This replica's id, resident adapters and engine state (tests, debugging)."""
        engine = self.engine.engine
        store = engine.adapters
        return {
            "replica": self.metrics.tags["replica"],
            "host_adapters": store.num_cached if store else 0,
            "resident_model_ids": sorted(self._resident_ids),
            "device_adapters": [a.name for a in engine.runner.lora_slots.resident]
            if engine.runner.lora_slots
            else [],
            "free_blocks": engine.kv_cache.pool.num_free,
            "total_blocks": engine.kv_cache.pool.num_blocks,
            "unfinished": engine.has_unfinished(),
            "streams": self.engine.num_streams,
            "shards": [dataclasses.asdict(shard) for shard in engine.shard_memory()],
        }

    async def generate(self, call: GenerateCall) -> AsyncIterator[StreamStep | GenerateError]:
        """Streams StreamSteps; a GenerateError is the only item when the input is bad."""
        started = time.perf_counter()
        first_token_s = None
        tracker = DeltaTracker(call.params.n)
        prompt_tokens = 0
        try:
            lora = await self._adapter_for_call()
            prompt = self._prompt_ids(call)
            params = self._fit_max_tokens(call, len(prompt))
            stream = self.engine.generate(prompt, params, request_id=call.request_id, adapter=lora)
            async for output in stream:
                step = tracker.step(output)
                prompt_tokens = step.prompt_tokens
                if first_token_s is None and any(d.num_new_tokens for d in step.deltas):
                    first_token_s = time.perf_counter() - started
                yield step
        except (ValueError, LookupError) as exc:
            logger.info("request %s rejected: %s", call.request_id, exc)
            yield GenerateError(404 if isinstance(exc, LookupError) else 400, str(exc))
            return
        elapsed = time.perf_counter() - started
        self.metrics.record_request(
            call.adapter, prompt_tokens, tracker.num_tokens, first_token_s, elapsed
        )
        logger.info(
            "request %s done: tenant=%s adapter=%s prompt=%d generated=%d in %.2fs",
            call.request_id,
            call.tenant or "-",
            call.adapter or "-",
            prompt_tokens,
            tracker.num_tokens,
            elapsed,
        )

    def check_health(self) -> None:
        self.engine.check_health()

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(drain_timeout_s=self.config.drain_timeout_s)


def _in_serve() -> bool:
    """True inside a Serve replica (tests also build a ModelServer directly)."""
    try:
        serve.get_replica_context()
    except Exception:
        return False
    return True


class DeltaTracker:
    """Turns cumulative RequestOutputs into per-completion deltas."""

    @property
    def num_tokens(self) -> int:
        """Tokens generated so far over every completion."""
        return sum(self._tokens)

    def __init__(self, n: int) -> None:
        self._text = [0] * n
        self._tokens = [0] * n
        self._logprobs = [0] * n
        self._finished = [False] * n

    def step(self, output: RequestOutput) -> StreamStep:
        deltas = []
        for completion in output.outputs:
            i = completion.index
            if self._finished[i]:
                continue
            text = completion.text[self._text[i] :]
            new_tokens = len(completion.token_ids) - self._tokens[i]
            logprobs = (completion.logprobs or [])[self._logprobs[i] :]
            if not text and not new_tokens and completion.finish_reason is None:
                continue
            self._text[i] = len(completion.text)
            self._tokens[i] = len(completion.token_ids)
            self._logprobs[i] += len(logprobs)
            self._finished[i] = completion.finish_reason is not None
            deltas.append(StreamDelta(i, text, new_tokens, completion.finish_reason, logprobs))
        return StreamStep(len(output.prompt_token_ids), deltas)
