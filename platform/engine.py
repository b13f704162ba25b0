"""LLMEngine: add_request / step / abort. One step = schedule -> execute -> update ->
detokenize -> finish what stopped (`check_stop`, platform/stop.py) -> outputs.

A step's failure that belongs to some requests ends just those (with an `error` on
their output); a failure of shared state propagates, and `reset()` then drops every
request and every cached block and slot so the same engine can go on (async_engine.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loraplex.adapters.peft_format import LoRAAdapter
from loraplex.adapters.slots import LoRASlots
from loraplex.adapters.store import AdapterStore
from loraplex.kernels.selection import kernel_backend
from loraplex.platform.arch import ModelArch
from loraplex.platform.block_pool import BlockPool
from loraplex.platform.compute_threads import default_compute_threads, use_compute_threads
from loraplex.platform.config import QUANTIZATIONS, EngineConfig
from loraplex.platform.cpu_allocator import keep_freed_memory, release_freed_memory
from loraplex.platform.decode_graphs import BUCKETS, DecodeGraphs, graph_memory_estimate
from loraplex.platform.dtype_choice import resolve_dtype
from loraplex.platform.failpoints import FAILPOINTS
from loraplex.platform.guided import GrammarCompiler, GuidedSpec
from loraplex.platform.kv_cache import plan_num_blocks
from loraplex.platform.kv_cache_manager import KVCacheManager
from loraplex.platform.layers.linear import has_folded_projections
from loraplex.platform.model_files import resolve_model_folder
from loraplex.platform.model_runner import AdapterActivationError, ModelRunner
from loraplex.platform.models.native_stack import NativeDecoderStack
from loraplex.platform.output_processor import OutputProcessor
from loraplex.platform.parallel.layout import TPLayout
from loraplex.platform.pooling import PoolingSpec, read_pooling
from loraplex.platform.rank_builder import RankSpec, build_rank
from loraplex.platform.request import Request, RequestFailure, RequestOutput, SamplingParams
from loraplex.platform.request_limits import EngineLimits, fit_embedding, fit_request
from loraplex.platform.scheduler import Scheduler
from loraplex.platform.scheduler_output import SchedulerOutput
from loraplex.platform.sleep_mode import (
    KVShape,
    SleepReport,
    move_tensors,
    release_kv_caches,
    restore_kv_caches,
)
from loraplex.platform.spec_decode import NgramProposer, SpecDecodeStats
from loraplex.platform.stop import check_stop
from loraplex.platform.tokenizer import encode_text, eos_token_ids, load_tokenizer
from loraplex.platform.tp_workers import (
    ShardMemory,
    TPWorkers,
    WorkerSpec,
    model_weight_bytes,
    tensor_bytes,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSnapshot:
    """What an engine holds now: adapters by tier, KV blocks, restarts."""

    host_adapters: int
    device_adapters: list[str]
    engine_restarts: int
    free_blocks: int
    """Blocks on the pool's free list."""
    unreferenced_blocks: int
    """Blocks whose reference count is 0: equal to `free_blocks` unless the pool's books
    disagree with themselves."""
    total_blocks: int
    block_refs: int
    """Sum of every block's reference count (0 once no request holds a block)."""
    num_preemptions: int
    unfinished: bool
    shards: list[dict]
    streams: int = 0
    """Streams open on the engine (AsyncEngine's; 0 for the engine alone)."""


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        started = time.monotonic()
        folder = resolve_model_folder(config.model.model)
        self.tokenizer = load_tokenizer(folder)
        self.eos_token_ids = eos_token_ids(folder, self.tokenizer)
        self.pooling: PoolingSpec = read_pooling(folder)
        """How this model's embeddings pool its hidden states (platform/pooling.py)."""
        self._set_up_compute(config)
        self._set_limits(config, ModelArch.from_folder(folder))
        self.runner = self._build_ranks(folder)
        self._set_up_adapter_store()
        self._spec_stats = SpecDecodeStats(self.config.speculative.num_speculative_tokens)
        self._build_request_state()
        self._capture_graphs(self.runner.model)
        self.restarts = 0
        self._asleep_kv: list[KVShape] | None = None
        """What the KV cache is allocated as again on wake (None: awake)."""
        self._grammars: GrammarCompiler | None = None
        self._log_ready(time.monotonic() - started, self.runner.lora_slots)

    def _set_up_compute(self, config: EngineConfig) -> None:
        """The device, the calling thread's torch threads, the torch seed, the kernels."""
        self.device = torch.device(config.model.device)
        if self.device.type == "cpu":
            keep_freed_memory()
        self.num_threads = config.model.num_threads or default_compute_threads()
        self.enter_compute_thread()
        torch.manual_seed(config.model.seed)
        self.kernel_backend = kernel_backend(self.device)

    def _set_limits(self, config: EngineConfig, arch: ModelArch) -> None:
        """The model's architecture, the config with dtype resolved, max_model_len."""
        self.arch = arch
        self.config = resolve_dtype(config, arch, self.device)
        """The engine's options with dtype resolved ('auto' never stays)."""
        self.max_model_len = self.config.model.max_model_len or arch.max_position_embeddings
        if self.max_model_len > arch.max_position_embeddings:
            logger.warning(
                "max_model_len %d exceeds the model's max_position_embeddings %d",
                self.max_model_len,
                arch.max_position_embeddings,
            )

    def _build_ranks(self, folder: Path) -> ModelRunner:
        """Sizes the KV cache, starts the tensor-parallel workers (if any) and builds rank
        0 (`build_rank`, as every worker builds its own); the workers stop if rank 0
        fails to build."""
        config = self.config
        tp_size = config.parallel.tensor_parallel_size
        layout = TPLayout.create(self.arch, 0, tp_size)
        self.num_blocks = plan_num_blocks(
            config.cache,
            self.arch,
            config.model.dtype,
            self.device,
            self.max_model_len,
            layout.num_kv_heads,
            reserved_bytes=self._graph_reserve_bytes(),
        )
        spec = RankSpec(
            folder=str(folder),
            dtype=config.model.dtype,
            device=str(self.device),
            kernels=self.kernel_backend,
            num_blocks=self.num_blocks,
            block_size=config.cache.block_size,
            max_loras=config.lora.max_loras,
            max_lora_rank=config.lora.max_lora_rank,
            quantization=QUANTIZATIONS.get(config.model.quantization or ""),
            quantize_lm_head=config.model.quantize_lm_head,
        )
        self.workers: TPWorkers | None = None
        if tp_size > 1:
            self.workers = self._start_workers(spec)
        group = self.workers.group if self.workers is not None else None
        try:
            return build_rank(spec, 0, group, self.workers)
        except BaseException:
            self.shutdown()
            raise

    def _uses_graphs(self) -> bool:
        """CUDA graphs for decode steps: on a GPU with the Triton kernels (the torch
        path's attention reads lengths back to the host), one rank, unless
        `enforce_eager`."""
        return (
            self.device.type == "cuda"
            and self.kernel_backend == "triton"
            and not self.config.model.enforce_eager
            and self.config.parallel.tensor_parallel_size == 1
        )

    def _graph_reserve_bytes(self) -> int:
        """What the decode graphs' memory pool may take, kept out of the KV budget."""
        if not self._uses_graphs():
            return 0
        arch = self.arch
        return graph_memory_estimate(
            arch.hidden_size,
            arch.intermediate_size,
            arch.vocab_size,
            self.config.model.dtype,
            min(self.config.scheduler.max_num_seqs, BUCKETS[-1]),
        )

    def _capture_graphs(self, model: torch.nn.Module) -> None:
        """Captures the decode graphs (see `_uses_graphs`) before the first step; on a
        CPU, hands the model's layer loop to its native stack unless `enforce_eager`."""
        model.rotary.cover(self.max_model_len)
        self.graph_pool_bytes = 0
        if self.device.type == "cpu" and not self.config.model.enforce_eager:
            model.native_stack = NativeDecoderStack.maybe(model)
        if not self._uses_graphs():
            return
        graphs = DecodeGraphs(
            self.runner.decode_logits,
            self.device,
            self.config.cache.block_size,
            self.max_model_len,
            min(self.config.scheduler.max_num_seqs, BUCKETS[-1]),
            self.config.lora.max_loras,
            self.kernel_backend,
            has_folded_projections(model),
        )
        graphs.capture()
        self.graph_pool_bytes = graphs.pool_bytes
        self.runner.graphs = graphs

    def _set_up_adapter_store(self) -> None:
        """The adapter store (host tier), None with LoRA off."""
        lora = self.config.lora
        self.adapters: AdapterStore | None = None
        if lora.enabled:
            self.adapters = AdapterStore(
                self.arch,
                lora.max_lora_rank,
                lora.max_cpu_loras,
                lora.adapter_root,
                max_vocab_size=lora.max_adapter_vocab_size,
                max_cpu_bytes=lora.max_cpu_lora_bytes,
            )

    def _log_ready(self, elapsed: float, lora_slots: LoRASlots | None) -> None:
        """Logs each tensor-parallel rank's memory and the engine's settings."""
        config = self.config
        tp_size = config.parallel.tensor_parallel_size
        if self.workers is not None:
            for shard in self.shard_memory():
                logger.info(
                    "tensor-parallel rank %d/%d (pid %d): weights %.1f MiB, KV cache %.1f MiB",
                    shard.rank,
                    tp_size,
                    shard.pid,
                    shard.weight_bytes / 2**20,
                    shard.kv_cache_bytes / 2**20,
                )
        logger.info(
            "engine ready in %.1fs: model=%s dtype=%s device=%s threads=%d kernels=%s tp=%d "
            "blocks=%d x %d tokens, "
            "max_model_len=%d, lora slots=%d x rank %d (%.1f MiB)",
            elapsed,
            config.model.model,
            config.model.dtype,
            self.device,
            torch.get_num_threads(),
            self.kernel_backend,
            tp_size,
            self.num_blocks,
            config.cache.block_size,
            self.max_model_len,
            config.lora.max_loras,
            config.lora.max_lora_rank,
            (lora_slots.num_bytes if lora_slots else 0) / 2**20,
        )

    def enter_compute_thread(self) -> None:
        """Applies this engine's torch thread count to the calling thread; a thread
        that steps the engine calls it first (see platform/compute_threads.py)."""
        if self.device.type == "cpu":
            use_compute_threads(self.num_threads)

    def warm_up(self) -> float:
        """Runs one full step's token budget of throwaway prompts through prefill and a
        few full-batch decode steps, then forgets them (fresh blocks, prefix cache and
        scheduler): the native kernels are built and loaded, and the largest activation
        buffers exist, before the first real request. Returns the seconds it took."""
        started = time.monotonic()
        scheduler = self.config.scheduler
        count = max(1, min(scheduler.max_num_seqs, self.num_blocks // 2))
        length = max(1, min(scheduler.max_num_batched_tokens // count, self.max_model_len - 8))
        vocab = self.arch.vocab_size
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        for index in range(count):
            prompt = [(index * 7919 + position * 104729) % vocab for position in range(length)]
            self.add_group(self.make_request_group(f"warm-up-{index}", prompt, params))
        while self.has_unfinished():
            self.step()
        queries, hits = self.kv_cache.prefix_queries, self.kv_cache.prefix_hits
        self._spec_stats = SpecDecodeStats(self.config.speculative.num_speculative_tokens)
        self._build_request_state()
        self.kv_cache.prefix_queries, self.kv_cache.prefix_hits = queries, hits
        elapsed = time.monotonic() - started
        logger.info("engine warmed up in %.1fs (%d prompts x %d tokens)", elapsed, count, length)
        return elapsed

    def _build_request_state(self) -> None:
        """Fresh block pool, block tables, scheduler queues and output groups."""
        config = self.config
        self.kv_cache = KVCacheManager(
            BlockPool(self.num_blocks), config.cache.block_size, config.cache.enable_prefix_caching
        )
        proposer = None
        if config.speculative.enabled:
            proposer = NgramProposer(config.speculative, self.max_model_len)
        self.scheduler = Scheduler(
            config.scheduler, self.kv_cache, config.lora.max_loras, proposer, self._spec_stats
        )
        self.outputs = OutputProcessor(self.tokenizer)

    def reset(self) -> None:
        """Drops every request, every cached KV block and every LoRA slot, keeping the
        weights: what a failed step may have left half-done is no longer trusted. Not
        possible under tensor parallelism (the workers may be inside a collective)."""
        if self.workers is not None:
            raise RuntimeError("a tensor-parallel engine cannot be reset in place")
        queries, hits = self.kv_cache.prefix_queries, self.kv_cache.prefix_hits
        self._build_request_state()
        self.kv_cache.prefix_queries, self.kv_cache.prefix_hits = queries, hits
        if self.runner.lora_slots is not None:
            self.runner.lora_slots.clear()
        self.restarts += 1

    def _start_workers(self, rank: RankSpec) -> TPWorkers:
        size = self.config.parallel.tensor_parallel_size
        spec = WorkerSpec(
            rank=rank,
            size=size,
            timeout_s=self.config.parallel.distributed_timeout_s,
            num_threads=max(1, (os.cpu_count() or 1) // size),
            num_cpus=self.config.parallel.worker_num_cpus,
        )
        return TPWorkers.start(spec)

    def shard_memory(self) -> list[ShardMemory]:
        """Weight and KV-cache bytes held by each tensor-parallel rank (rank 0 first)."""
        runner = self.runner
        weights, kv = model_weight_bytes(runner.model), tensor_bytes(runner.kv_caches)
        own = ShardMemory(0, weights, kv, os.getpid())
        return [own] + (self.workers.memory if self.workers is not None else [])

    def check_health(self) -> None:
        """RuntimeError when a tensor-parallel worker has died."""
        if self.workers is not None:
            self.workers.check()

    def shutdown(self) -> None:
        """Stops the tensor-parallel workers and hands the process's freed memory back
        to the kernel (platform/cpu_allocator.py)."""
        if self.workers is not None:
            self.workers.shutdown()
        release_freed_memory()

    # ---- adapters ------------------------------------------------------------------
    def _store(self) -> AdapterStore:
        if self.adapters is None:
            raise ValueError("LoRA is disabled on this engine (max_loras=0)")
        return self.adapters

    def register_adapter(self, name: str, folder: str) -> None:
        """Names an adapter folder at runtime; requests may then use the name."""
        self._store().register(name, folder)

    def unregister_adapter(self, name: str) -> None:
        self._store().unregister(name)

    def load_adapter(self, adapter: str | LoRAAdapter | None) -> LoRAAdapter | None:
        """A registered name or a folder -> the validated, loaded adapter (blocking)."""
        if adapter is None or isinstance(adapter, LoRAAdapter):
            return adapter
        return self._store().load(adapter)

    # ---- requests ------------------------------------------------------------------
    def tokenizer_for(self, lora: LoRAAdapter | None) -> Any:
        """The tokenizer of requests on `lora`: its own where it resized the vocabulary,
        else the model's."""
        if lora is not None and lora.tokenizer is not None:
            return lora.tokenizer
        return self.tokenizer

    def vocab_size_for(self, lora: LoRAAdapter | None) -> int:
        """The token ids requests on `lora` may hold: the model's vocabulary, or the
        adapter's resized one."""
        if lora is not None and lora.vocab_size is not None:
            return lora.vocab_size
        return self.arch.vocab_size

    def tokenize(self, prompt: str | Sequence[int], lora: LoRAAdapter | None = None) -> list[int]:
        if isinstance(prompt, str):
            return encode_text(self.tokenizer_for(lora), prompt)
        return [int(t) for t in prompt]

    def detokenize(self, token_ids: Sequence[int], lora: LoRAAdapter | None = None) -> str:
        """The text of `token_ids` (in `lora`'s tokenizer where it has one), special
        tokens kept; ValueError for ids outside the vocabulary."""
        vocab = self.vocab_size_for(lora)
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids out of range [0, {vocab}): {bad[:5]}")
        return self.tokenizer_for(lora).decode(list(token_ids), skip_special_tokens=False)

    def make_request_group(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        lora: LoRAAdapter | None = None,
        cache_salt: str | None = None,
        grammar: object | None = None,
        tenant: str = "",
        tenant_weight: float = 1.0,
        embed: bool = False,
    ) -> list[Request]:
        """Validates a prompt and builds its n Requests. Raises ValueError on bad input.
        `embed`: one request that pools its prompt into an embedding (`self.pooling`)
        and generates nothing; `params` then only bounds its length (n must be 1).
        `lora` is an adapter already loaded (see `load_adapter`); `cache_salt` keeps the
        request's prefix-cache entries apart from other salts' (one per tenant);
        `tenant` and `tenant_weight` are what the `fair` policy shares the engine by;
        `grammar` is `params.guided` compiled for `tenant` (`compile_grammar`; compiled
        here when None), each completion gets its own matcher over it."""
        token_ids = self.tokenize(prompt, lora)
        if not token_ids:
            raise ValueError("prompt is empty: it must contain at least one token")
        if embed:
            fit_embedding(len(token_ids), self.limits)
        else:
            fit_request(len(token_ids), params, self.limits)
        vocab = self.vocab_size_for(lora)
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        self._check_ids_in_vocab(params, vocab)
        if params.guided is not None and vocab != self.arch.vocab_size:
            raise ValueError(
                f"structured output is not served on adapter {lora.name!r}: it resizes the "
                f"vocabulary to {vocab} tokens"
            )
        if not tenant_weight > 0:
            raise ValueError(f"tenant_weight must be > 0, got {tenant_weight}")
        salt = cache_salt.encode() if cache_salt is not None else None
        arrival = time.monotonic() if arrival_time is None else arrival_time
        if embed and (params.n != 1 or params.guided is not None):
            raise ValueError("an embedding request takes n = 1 and no structured output")
        if params.guided is not None and grammar is None:
            grammar = self.compile_grammar(params.guided, tenant)
        n = params.n
        requests = [
            Request(
                request_id=request_id if n == 1 else f"{request_id}-{index}",
                prompt_token_ids=token_ids,
                sampling_params=params,
                eos_token_ids=self.eos_token_ids,
                arrival_time=arrival,
                priority=priority,
                lora=lora,
                tenant=tenant,
                tenant_weight=tenant_weight,
                group_id=request_id,
                index=index,
                cache_salt=salt,
                grammar=self.grammars.state(grammar, params.guided)
                if grammar is not None
                else None,
                pooling=self.pooling if embed else None,
            )
            for index in range(n)
        ]
        return requests

    @property
    def grammars(self) -> GrammarCompiler:
        """The structured-output compiler for this model's tokenizer (made on first use)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(
                self.tokenizer, self.arch.vocab_size, sorted(self.eos_token_ids)
            )
        return self._grammars

    def compile_grammar(self, spec: GuidedSpec, tenant: str = "") -> object:
        """`spec` compiled for this model's tokenizer (cached per tenant, by content: no
        tenant's request finds another's grammar compiled); ValueError when it does not
        compile. Thread-safe: AsyncEngine calls it off the engine loop."""
        return self.grammars.compile(spec, tenant)

    @property
    def limits(self) -> EngineLimits:
        """What this engine can hold (platform/request_limits.py fits requests to it)."""
        return EngineLimits(self.max_model_len, self.num_blocks, self.config.cache.block_size)

    def _check_ids_in_vocab(self, params: SamplingParams, vocab: int) -> None:
        """ValueError unless a vocabulary of `vocab` tokens has every id `params` name."""
        if params.top_k > vocab:
            raise ValueError(
                f"top_k must be at most the vocabulary size {vocab}, got {params.top_k}"
            )
        bad_stops = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad_stops:
            raise ValueError(f"stop_token_ids out of range [0, {vocab}): {bad_stops[:5]}")
        bad_bias = [t for t, _ in params.logit_bias if not 0 <= t < vocab]
        if bad_bias:
            raise ValueError(f"logit_bias token ids out of range [0, {vocab}): {bad_bias[:5]}")

    @property
    def asleep(self) -> bool:
        return self._asleep_kv is not None

    def sleep(self) -> SleepReport:
        """Releases the KV cache (the prefix cache with it) and, on a GPU, moves the
        weights to pinned host memory (platform/sleep_mode.py). ValueError while
        requests are unfinished, when asleep already, or under tensor parallelism."""
        if self.asleep:
            raise ValueError("the engine is asleep already")
        if self.workers is not None:
            raise ValueError("sleep needs tensor_parallel_size 1 (this engine has workers)")
        if self.has_unfinished():
            raise ValueError("requests are still running; sleep once they finished")
        started = time.monotonic()
        self.reset()
        self.runner.graphs = None
        self._asleep_kv, kv_bytes = release_kv_caches(self.runner.kv_caches)
        weight_bytes = move_tensors([self.runner.model], torch.device("cpu"))
        self._give_back_freed_memory()
        report = SleepReport(time.monotonic() - started, kv_bytes, weight_bytes)
        logger.info(
            "engine asleep in %.3f s: KV cache %.1f MiB released, weights %.1f MiB to host",
            report.seconds,
            kv_bytes / 2**20,
            weight_bytes / 2**20,
        )
        return report

    def wake_up(self) -> SleepReport:
        """Undoes `sleep`: a zeroed KV cache of the same size, the weights back on the
        device, the decode graphs captured again. ValueError when awake."""
        if self._asleep_kv is None:
            raise ValueError("the engine is awake")
        started = time.monotonic()
        weight_bytes = move_tensors([self.runner.model], self.device)
        kv_bytes = restore_kv_caches(self.runner.kv_caches, self._asleep_kv)
        self._asleep_kv = None
        self._capture_graphs(self.runner.model)
        report = SleepReport(time.monotonic() - started, kv_bytes, weight_bytes)
        logger.info(
            "engine awake in %.3f s: KV cache %.1f MiB allocated, weights %.1f MiB on %s",
            report.seconds,
            kv_bytes / 2**20,
            weight_bytes / 2**20,
            self.device,
        )
        return report

    def _give_back_freed_memory(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            release_freed_memory()

    def add_group(self, group: list[Request]) -> None:
        if self.asleep:
            raise ValueError("the engine is asleep: wake it up first")
        group_id = group[0].group_id
        if group_id in self.outputs:
            raise ValueError(f"request id {group_id!r} is already in use")
        self.scheduler.add(group)
        self.outputs.add(group)

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        priority: int = 0,
        adapter: str | LoRAAdapter | None = None,
    ) -> None:
        """Queues a request; `adapter` is a registered name, an adapter folder or a loaded
        adapter (None: the base model). Loading a new adapter here blocks the caller;
        AsyncEngine loads off the loop instead."""
        lora = self.load_adapter(adapter)
        self.add_group(self.make_request_group(request_id, prompt, params, priority, lora=lora))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Aborts a request group at any time; its blocks are freed at once."""
        if self.scheduler.abort_group(request_id) or request_id in self.outputs:
            return self.outputs.abort(request_id)
        return None

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- the loop ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration. A failure that belongs to requests (their sampling, their
        logits, their adapter's slot) ends only those requests; anything else raises,
        and the caller resets the engine (`reset`)."""
        if FAILPOINTS.active:
            FAILPOINTS.hit("engine.delay")
        output = self.scheduler.schedule()
        if output.empty:
            return []
        if FAILPOINTS.active:
            FAILPOINTS.hit("engine.step")
        try:
            result = self.runner.execute(output)
        except AdapterActivationError as exc:
            logger.error("%s; failing its requests", exc)
            return self._fail_adapter(output, exc)
        updated = self.scheduler.update(
            output, result.sampled, result.failed, result.prompt_logprobs, result.pooled
        )
        for request in updated:
            if request.failure is not None:
                logger.warning("request %s failed: %s", request.request_id, request.failure.message)
        self._take_new_tokens(updated, result.sampled)
        return self.outputs.outputs(updated)

    def _take_new_tokens(
        self, updated: list[Request], sampled: Mapping[str, Sequence[tuple[int, object]]]
    ) -> None:
        """Detokenizes each request's new tokens and asks `check_stop` after each, one
        token at a time: the scheduler appended the first; a request with more (accepted
        drafts and a bonus token) gets the next appended while the ones before did not
        end it, so its output ends exactly where a one-token-per-step run would."""
        batch = updated
        index = 0
        while batch:
            detokenized = self.outputs.detokenize(batch)
            self._finish_stopped(batch, detokenized.stop_strings)
            for group_id, failure in detokenized.failed.items():
                self.scheduler.fail_group(group_id, failure)
            index += 1
            batch = [
                request
                for request in batch
                if not request.finished and len(sampled.get(request.request_id, ())) > index
            ]
            for request in batch:
                request.append_output_token(*sampled[request.request_id][index])

    def _finish_stopped(self, updated: list[Request], stop_strings: Mapping[str, str]) -> None:
        """Ends (through the scheduler: blocks freed at once) every request of `updated`
        that `check_stop` says stops after its new token."""
        for request in updated:
            if request.finished:
                continue
            stop = check_stop(request, self.max_model_len, stop_strings.get(request.request_id))
            if stop is not None:
                request.stop_reason = stop.reason
                self.scheduler.finish(request, stop.status)

    def _fail_adapter(
        self, output: SchedulerOutput, exc: AdapterActivationError
    ) -> list[RequestOutput]:
        """The step never ran: undo what it published and end the adapter's requests."""
        self.scheduler.abandon(output)
        failure = RequestFailure(str(exc), client_fault=True)
        groups = {
            r.group_id for r in self.scheduler.requests.values() if r.adapter_key == exc.adapter_key
        }
        failed = [m for group in groups for m in self.scheduler.fail_group(group, failure)]
        return self.outputs.outputs(failed)

    @property
    def spec_stats(self) -> SpecDecodeStats:
        """Speculative decoding's acceptance counters since the engine warmed up (all 0
        with it off); resets keep them."""
        return self._spec_stats

    def load_adapter_async(
        self,
        adapter: str | Path,
        name: str | None = None,
        root: Path | None = None,
        version: int | None = None,
        model_id: str | None = None,
    ) -> Future[LoRAAdapter]:
        """Loads an adapter into the host tier on the store's threads (AdapterStore
        .load_async; `model_id` labels the copy for `held_adapter`); ValueError with
        LoRA off."""
        return self._store().load_async(adapter, name, root, version, model_id)

    def held_adapter(self, model_id: str) -> LoRAAdapter | None:
        """The host copy loaded under a catalog model id, if the host tier still holds
        it (None with LoRA off)."""
        return self.adapters.held(model_id) if self.adapters is not None else None

    def held_adapter_ids(self) -> dict[str, bytes]:
        """Model id -> identity key of every host copy loaded under a model id."""
        return self.adapters.held_ids() if self.adapters is not None else {}

    def on_adapter_evicted(self, listener: Callable[[str], None]) -> None:
        """`listener` hears the model id of every host copy that leaves host memory (on
        the thread that evicted it); a no-op with LoRA off."""
        if self.adapters is not None:
            self.adapters.on_evict(listener)

    def evict_adapter(self, folder: str | Path, version: int | None) -> None:
        """Drops an adapter's host copy (a no-op when LoRA is off or it is not held)."""
        if self.adapters is not None:
            self.adapters.evict(folder, version)

    def device_adapter_keys(self) -> set[bytes]:
        """Identity keys of the adapters now in the LoRA slots."""
        slots = self.runner.lora_slots
        return {adapter.key for adapter in list(slots.resident)} if slots is not None else set()

    def snapshot(self) -> EngineSnapshot:
        """What the engine holds now (AsyncEngine.snapshot adds its open streams)."""
        pool = self.kv_cache.pool
        slots = self.runner.lora_slots
        return EngineSnapshot(
            host_adapters=self.adapters.num_cached if self.adapters else 0,
            device_adapters=[a.name for a in slots.resident] if slots else [],
            engine_restarts=self.restarts,
            free_blocks=pool.num_free,
            unreferenced_blocks=sum(b.ref_count == 0 for b in pool.blocks),
            total_blocks=pool.num_blocks,
            block_refs=sum(block.ref_count for block in pool.blocks),
            num_preemptions=self.scheduler.num_preemptions,
            unfinished=self.has_unfinished(),
            shards=[dataclasses.asdict(shard) for shard in self.shard_memory()],
        )

    def stats(self) -> dict[str, float]:
        kv = self.kv_cache
        stats = {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": kv.pool.usage,
            "prefix_cache_queries": kv.prefix_queries,
            "prefix_cache_hits": kv.prefix_hits,
            "engine_restarts": self.restarts,
            "num_preemptions": self.scheduler.num_preemptions,
        }
        if self.config.speculative.enabled:
            stats.update(self.spec_stats.as_stats())
        slots = self.runner.lora_slots
        if self.adapters is not None and slots is not None:
            stats.update(
                lora_resident=len(slots.resident),
                lora_slot_loads=slots.stats.loads,
                lora_slot_evictions=slots.stats.evictions,
                lora_host_cached=self.adapters.num_cached,
                lora_device_bytes=slots.num_bytes,
                lora_host_bytes=self.adapters.held_bytes,
                lora_host_loads=self.adapters.stats.loads,
                lora_host_evictions=self.adapters.stats.evictions,
            )
        return stats
