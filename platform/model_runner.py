"""Turns a SchedulerOutput into tensors, runs the model, samples. Makes no decisions.

Per step it builds the flattened batch (decodes first, then prefill chunks; see
kernels/attention_metadata.py), applies pending copy-on-write block copies, runs the model,
computes logits only for the rows that sample, and lets the sampler pick tokens.

With LoRA, the step's adapters are made resident in device slots first, and decodes
and prefill chunks are each ordered by slot so every adapter's tokens are contiguous
(one segment per adapter and kind; see kernels/lora.py).

A request asking for prompt logprobs also has the positions of its chunk that score
prompt tokens listed (platform/prompt_logprobs.py); their logits are computed slice by
slice after the sampling rows' and reduced to logprobs at once.

An embedding request's chunk lists the positions it pools (platform/pooling.py); their
final hidden states are summed per request in float32 and handed back with the step's
result, and it samples nothing.

A speculating decode (platform/spec_decode.py) is a chunk of its newest token and its
drafts, placed with the prefill chunks, and samples at every one of its positions;
the drafts are verified against those tokens and the request gets the accepted drafts
and one bonus token.

Failures that belong to one request stay with it: a row whose logits are not finite,
or whose sampling raises (the batch is then sampled again row by row, seeded
generators rewound), is reported in `StepResult.failed` and every other row keeps its
token. An adapter that cannot be written into a slot raises `AdapterActivationError`
before the model ran, naming the adapter, so the engine ends only its requests (the
step's block copies are still made, on every rank: its other requests go on).

Every tensor-parallel rank owns a runner over its shard and runs each step with the same
`run(StepInputs)`: block copies, forward, logits of the sampling rows. Only rank 0
prepares steps and samples; it hands each step's inputs (with the block copies and the
adapter slot writes it made while preparing) to the other ranks before running it, and
the collectives inside the model keep the ranks together (tp_workers.py).

On a GPU with CUDA graphs captured (platform/decode_graphs.py, one rank only), a step
of decodes alone (no prefill chunk, no drafts, no prompt rows) skips the eager forward:
its inputs go into the graphs' static buffers and the bucket's graph replays.

    rank 0: execute(output)                      rank r > 0: worker loop
      prepare_inputs -> StepInputs (slots written)
      workers.send(inputs) ----------------------> write_slots(inputs.slot_writes)
      run(inputs)  <-- collectives -->             run(inputs)
      sample(logits)
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from loraplex.adapters.peft_format import LoRAAdapter
from loraplex.adapters.slots import LoRASlots
from loraplex.kernels.attention_metadata import AttentionMetadata
from loraplex.kernels.backends import get_backend
from loraplex.kernels.lora import LoRABatch
from loraplex.platform.decode_graphs import DecodeGraphs, DecodeStep
from loraplex.platform.failpoints import FAILPOINTS
from loraplex.platform.guided import GuidedState
from loraplex.platform.kv_cache import copy_blocks
from loraplex.platform.pooling import rows_to_pool
from loraplex.platform.prompt_logprobs import (
    PromptRows,
    PromptScores,
    book_scores,
    positions_to_score,
    score_rows,
)
from loraplex.platform.request import Logprob, Request, RequestFailure
from loraplex.platform.sampler import Sampler, SamplerOutput, SamplingBatch
from loraplex.platform.scheduler_output import ScheduledRequest, SchedulerOutput
from loraplex.platform.spec_decode import num_accepted

logger = logging.getLogger(__name__)


class AdapterActivationError(RuntimeError):
    """An adapter could not be written into a device slot; nothing of the step ran."""

    def __init__(self, adapter_key: bytes, message: str) -> None:
        super().__init__(message)
        self.adapter_key = adapter_key


@dataclass
class StepResult:
    sampled: dict[str, list[tuple[int, Logprob | None]]] = field(default_factory=dict)
    """request id -> its new tokens, each (token, logprob or None): one, or after a
    speculating decode the accepted drafts and the bonus token"""
    failed: dict[str, RequestFailure] = field(default_factory=dict)
    """request id -> why it got no token (only that request ends)"""
    prompt_logprobs: dict[str, list[Logprob]] = field(default_factory=dict)
    """request id -> the prompt tokens' Logprobs its chunk scored, in order"""
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)
    """request id -> the sum of the hidden states its chunk pooled ([hidden] float32)"""


@dataclass(frozen=True)
class PoolRows:
    """The step's tokens whose final hidden states embedding requests pool."""

    rows: torch.Tensor
    """[P] int64 index into the step's tokens."""
    owners: torch.Tensor
    """[P] int64: which of the step's `count` pooling requests each row adds to."""
    count: int


@dataclass(frozen=True)
class StepInputs:
    """What every rank runs one step from (rank 0 builds it, the other ranks receive it
    pickled): T tokens, decodes first, then prefill chunks; R sampling rows."""

    input_ids: torch.Tensor
    """[T] int64 token ids."""
    positions: torch.Tensor
    """[T] int64 position of each token in its sequence."""
    meta: AttentionMetadata
    lora: LoRABatch | None
    """Adapter slot of each token (None: every token runs the base model)."""
    sample_rows: torch.Tensor
    """[R] int64 index into the step's tokens of each sampling row (repeats for forks)."""
    block_copies: tuple[tuple[int, int], ...]
    """(src, dst) copy-on-write block copies, made before the forward."""
    slot_writes: tuple[tuple[int, LoRAAdapter], ...]
    """(slot, adapter) written into rank 0's LoRA slots while this step was prepared;
    the other ranks write them into their shards' slots before running it."""
    prompt_rows: PromptRows | None = None
    """The step's tokens whose logits score prompt tokens (None: no request asked)."""
    pool_rows: PoolRows | None = None
    """The step's tokens that embedding requests pool (None: no such request)."""


@dataclass(frozen=True)
class StepLogits:
    """What one rank's forward gives back: the sampling rows' float32 logits [R, vocab]
    (None when no row samples), the prompt rows' scores (None when none) and the pooled
    sums [count, hidden] float32 of the embedding requests (None when none)."""

    sample: torch.Tensor | None = None
    prompt: PromptScores | None = None
    pooled: torch.Tensor | None = None


@dataclass(frozen=True)
class PreparedStep:
    """Rank 0's step: the inputs every rank runs, and whom each sampling row is for."""

    inputs: StepInputs
    sample_requests: list[Request]
    """[R] the request row r of `inputs.sample_rows` samples for (a speculating request
    has 1 + d consecutive rows, one per query position)."""
    drafts: dict[str, list[int]] = field(default_factory=dict)
    """request id -> the drafts its rows verify (speculating requests only)."""
    prompt_owners: list[tuple[Request, range]] = field(default_factory=list)
    """Whose prompt rows `inputs.prompt_rows` holds, in row order, and the positions
    each scores."""
    pool_owners: list[Request] = field(default_factory=list)
    """The embedding requests `inputs.pool_rows` pools for, by owner index."""


class StepFollowers(Protocol):
    """The tensor-parallel ranks 1.. (`TPWorkers` in tp_workers.py)."""

    def send(self, inputs: StepInputs) -> None:
        """Hands them the step rank 0 is about to run; each runs it with rank 0."""


def _pad_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max((len(t) for t in tables), default=0)
    padded = [t + [0] * (width - len(t)) for t in tables]
    return torch.tensor(padded, dtype=torch.int64, device=device).reshape(len(tables), width)


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        device: torch.device,
        lora_slots: LoRASlots | None = None,
        workers: StepFollowers | None = None,
    ) -> None:
        """One rank's runner over its shard: `model`, its per-layer `kv_caches` and its
        LoRA slots. `workers` (rank 0 of several ranks only) get each step's inputs."""
        self.model = model
        self.workers = workers
        """Tensor-parallel ranks 1.. (None on one rank and on the workers themselves)."""
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.lora_slots = lora_slots
        self.sampler = Sampler(get_backend(model.kernels))
        self.graphs: DecodeGraphs | None = None
        """Captured decode forwards (None: every step runs eagerly)."""

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> StepResult:
        """Rank 0 runs one step (with the other ranks, if any): the sampled token of every
        sampling request, or why it failed. AdapterActivationError when an adapter
        cannot take a slot: then only the step's block copies were made."""
        if self.graphs is not None and self._graphable(output):
            return self._execute_graph(output)
        try:
            step = self.prepare_inputs(output)
        except AdapterActivationError:
            if output.block_copies:
                # The step's other requests go on, and need their copy-on-write blocks.
                self._lead(self.prepare_inputs(SchedulerOutput([], output.block_copies)).inputs)
            raise
        logits = self._lead(step.inputs)
        result = StepResult()
        if logits.sample is not None:
            result = self.sample(logits.sample, step.sample_requests, step.drafts)
        if logits.prompt is not None:
            _book_prompt_scores(result, logits.prompt, step.prompt_owners)
        if logits.pooled is not None:
            for request, pooled in zip(step.pool_owners, logits.pooled, strict=True):
                result.pooled[request.request_id] = pooled
        return result

    def _graphable(self, output: SchedulerOutput) -> bool:
        """Whether a captured graph runs this step: decodes alone, no more than the
        largest bucket, none scoring a prompt position."""
        scheduled = output.scheduled
        if not scheduled or len(scheduled) > self.graphs.max_batch:
            return False
        for item in scheduled:
            if item.num_query_tokens != 1 or item.draft_token_ids:
                return False
            request = item.request
            if request.pooling is not None:
                return False
            if request.lora is not None and request.lora.saved_modules:
                return False
            if positions_to_score(request, request.num_computed_tokens, item.num_tokens):
                return False
            if len(item.block_ids) > self.graphs.max_blocks:
                return False
        return True

    def _execute_graph(self, output: SchedulerOutput) -> StepResult:
        """`execute` for a step `_graphable` accepted: the block copies, the bucket's
        graph, then sampling as on the eager path."""
        try:
            slot_of = self._slots(output)
        except AdapterActivationError:
            copy_blocks(self.kv_caches, output.block_copies)
            raise
        if self.lora_slots is not None:
            self.lora_slots.take_loads()  # one rank: the writes are already in the slots

        def slot(item: ScheduledRequest) -> int:
            key = item.request.adapter_key
            return -1 if key is None else slot_of[key]

        decodes = sorted(output.scheduled, key=slot)
        size = self.block_size
        token_ids, positions, cache_slots, lens = [], [], [], []
        sample_rows: list[int] = []
        sample_requests: list[Request] = []
        for row, item in enumerate(decodes):
            request = item.request
            position = request.num_computed_tokens
            token_ids.append(request.all_token_ids[position])
            positions.append(position)
            cache_slots.append(item.block_ids[position // size] * size + position % size)
            lens.append(position + 1)
            if item.samples:
                for member in [request, *output.forks.get(request.request_id, ())]:
                    sample_rows.append(row)
                    sample_requests.append(member)
        step = DecodeStep(
            token_ids=token_ids,
            positions=positions,
            cache_slots=cache_slots,
            context_lens=lens,
            block_tables=[item.block_ids for item in decodes],
            adapter_slots=[slot(item) for item in decodes] if slot_of else None,
        )
        copy_blocks(self.kv_caches, output.block_copies)
        logits = self.graphs.run(step)
        if not sample_rows:
            return StepResult()
        if sample_rows != list(range(len(decodes))):
            index = torch.tensor(sample_rows, dtype=torch.int64, device=self.device)
            logits = logits.index_select(0, index)
        return self.sample(logits, sample_requests)

    def _lead(self, inputs: StepInputs) -> StepLogits:
        """Rank 0: hands `inputs` to the other ranks, then runs them (see `run`)."""
        if self.workers is not None:
            self.workers.send(inputs)
        return self.run(inputs)

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> StepLogits:
        """Runs one step on this rank's shard, as every rank does: the block copies, the
        forward (whose collectives pair with the other ranks'), then the logits of the
        sampling rows and the scores of the prompt rows."""
        copy_blocks(self.kv_caches, inputs.block_copies)
        if not inputs.input_ids.numel():
            return StepLogits()
        hidden = self.model(
            inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, inputs.lora
        )
        sample = None
        if inputs.sample_rows.numel():
            sample = self._logits(hidden, inputs.sample_rows, inputs.lora)
        prompt = None
        if inputs.prompt_rows is not None:
            prompt = score_rows(
                lambda index: self._logits(hidden, index, inputs.lora), inputs.prompt_rows
            )
        pooled = None
        if inputs.pool_rows is not None:
            pool = inputs.pool_rows
            pooled = hidden.new_zeros(pool.count, hidden.shape[-1], dtype=torch.float32)
            pooled.index_add_(0, pool.owners, hidden[pool.rows].float())
        return StepLogits(sample, prompt, pooled)

    def _logits(
        self, hidden: torch.Tensor, index: torch.Tensor, lora: LoRABatch | None
    ) -> torch.Tensor:
        """float32 logits of the step's token rows `index` [R]: through the LM head of
        the adapter a row's slot holds, where it saved one (adapters/saved_modules.py),
        else the base model's."""
        rows = hidden[index]
        saved = self.lora_slots.saved if self.lora_slots is not None else None
        if lora is None or saved is None or not saved.has_heads:
            return self.model.compute_logits(rows)
        return saved.logits(rows, lora.token_slots[index], self.model.compute_logits)

    def decode_logits(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        lora: LoRABatch | None,
    ) -> torch.Tensor:
        """The forward of a step of decodes only, every token sampling: float32 logits
        [D, vocab] (what a decode graph captures; platform/decode_graphs.py)."""
        hidden = self.model(input_ids, positions, self.kv_caches, meta, lora)
        return self.model.compute_logits(hidden)

    def write_slots(self, writes: Sequence[tuple[int, LoRAAdapter]]) -> None:
        """Writes each (slot, adapter) into this rank's LoRA slots: a worker's share of
        the slot writes rank 0 made in `prepare_inputs` (`StepInputs.slot_writes`)."""
        if not writes:
            return
        if self.lora_slots is None:
            raise RuntimeError("adapter slot write on a runner without LoRA slots")
        for slot, adapter in writes:
            self.lora_slots.load(adapter, slot)
        self.lora_slots.take_loads()

    def sample(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        drafts: Mapping[str, list[int]] | None = None,
    ) -> StepResult:
        """Samples one token per row of `logits[R, V]` and verifies the `drafts` of the
        speculating requests (their rows are consecutive); a row that cannot be sampled
        fails its own request only."""
        drafts = drafts or {}
        generators = [r.generator for r in requests if r.generator is not None]
        states = [g.get_state() for g in generators]
        try:
            sampled = self._sample_batch(logits, requests)
        except Exception:
            logger.exception(
                "batched sampling failed; sampling the %d rows one by one", len(requests)
            )
            for generator, state in zip(generators, states, strict=True):
                generator.set_state(state)
            return self._sample_rows(logits, requests, drafts)
        result = StepResult()
        self._collect(result, requests, [(sampled, row) for row in range(len(requests))], drafts)
        return result

    def _sample_batch(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        if FAILPOINTS.active:
            for request in requests:
                FAILPOINTS.hit("sampler.row", request)
        return self.sampler(logits, SamplingBatch.from_requests(requests, self.device))

    def _sample_rows(
        self, logits: torch.Tensor, requests: list[Request], drafts: Mapping[str, list[int]]
    ) -> StepResult:
        result = StepResult()
        outputs: list[tuple[SamplerOutput, int] | None] = []
        for row, request in enumerate(requests):
            try:
                outputs.append((self._sample_batch(logits[row : row + 1], [request]), 0))
            except Exception as exc:
                logger.error("request %s: sampling failed: %r", request.request_id, exc)
                result.failed[request.request_id] = RequestFailure(
                    f"sampling failed inside the engine: {exc}"
                )
                outputs.append(None)
        kept = [i for i, output in enumerate(outputs) if output is not None]
        failed = set(result.failed)
        kept = [i for i in kept if requests[i].request_id not in failed]
        self._collect(result, [requests[i] for i in kept], [outputs[i] for i in kept], drafts)
        return result

    @staticmethod
    def _collect(
        result: StepResult,
        requests: list[Request],
        rows: list[tuple[SamplerOutput, int]],
        drafts: Mapping[str, list[int]],
    ) -> None:
        """Books each request's new tokens, (sampler output, row) per row in `rows`: a
        speculating request's consecutive rows verify its drafts (spec_decode.py) and
        only the rows of the tokens it keeps are checked; a guided request's grammar
        takes its token."""
        start = 0
        while start < len(rows):
            request = requests[start]
            count = 1 + len(drafts.get(request.request_id, ()))
            run = rows[start : start + count]
            start += count
            keep = 1
            if count > 1:
                targets = [sampled.token_ids[row] for sampled, row in run]
                keep += num_accepted(drafts[request.request_id], targets)
            tokens = []
            for sampled, row in run[:keep]:
                failure = _row_failure(request, sampled, row)
                if failure is not None:
                    result.failed[request.request_id] = failure
                    break
                tokens.append((sampled.token_ids[row], sampled.logprobs[row]))
            else:
                result.sampled[request.request_id] = tokens

    def _slots(self, output: SchedulerOutput) -> dict[bytes, int]:
        """Adapter key -> device slot for this step's adapters (loaded as needed)."""
        adapters = [s.request.lora for s in output.scheduled if s.request.lora is not None]
        if not adapters:
            return {}
        if self.lora_slots is None:
            raise RuntimeError("a request uses a LoRA adapter, but LoRA is disabled")
        try:
            return self.lora_slots.activate(adapters)
        except Exception as exc:
            failing = self.lora_slots.failed_adapter
            if failing is None:
                raise
            raise AdapterActivationError(
                failing.key, f"adapter {failing.name!r} could not be loaded into a slot: {exc}"
            ) from exc

    def prepare_inputs(self, output: SchedulerOutput) -> PreparedStep:
        """Rank 0: makes the step's adapters resident (AdapterActivationError naming the
        one that cannot be), then flattens the batch, each kind ordered by slot."""
        slot_of = self._slots(output)

        def slot(item: ScheduledRequest) -> int:
            key = item.request.adapter_key
            return -1 if key is None else slot_of[key]

        decodes = sorted((s for s in output.scheduled if s.num_query_tokens == 1), key=slot)
        prefills = sorted((s for s in output.scheduled if s.num_query_tokens > 1), key=slot)
        slot_runs: list[tuple[int, int]] = []
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_requests: list[Request] = []
        size = self.block_size
        drafts: dict[str, list[int]] = {}
        prompt_owners: list[tuple[Request, range]] = []
        prompt_rows: list[int] = []
        prompt_targets: list[int] = []
        pool_owners: list[Request] = []
        pool_rows: list[int] = []
        pool_owner_of_row: list[int] = []
        for item in decodes + prefills:
            request = item.request
            start = request.num_computed_tokens
            stop = start + item.num_query_tokens
            if request.pooling is not None:
                pooled = rows_to_pool(
                    request.pooling, start, start + item.num_tokens, request.num_prompt_tokens
                )
                if pooled:
                    offset = len(token_ids) - start
                    pool_rows.extend(offset + p for p in pooled)
                    pool_owner_of_row.extend([len(pool_owners)] * len(pooled))
                    pool_owners.append(request)
            scored = positions_to_score(request, start, item.num_tokens)
            if scored:
                offset = len(token_ids) - start
                prompt_owners.append((request, scored))
                prompt_rows.extend(offset + p for p in scored)
                prompt_targets.extend(request.prompt_token_ids[p + 1] for p in scored)
            token_ids.extend(request.all_token_ids[start : start + item.num_tokens])
            token_ids.extend(item.draft_token_ids)
            slot_runs.append((slot(item), item.num_query_tokens))
            positions.extend(range(start, stop))
            table = item.block_ids
            slots.extend(table[p // size] * size + p % size for p in range(start, stop))
            if item.draft_token_ids:
                drafts[request.request_id] = item.draft_token_ids
                first = len(token_ids) - item.num_query_tokens
                sample_rows.extend(range(first, len(token_ids)))
                sample_requests.extend([request] * item.num_query_tokens)
            elif item.samples:
                row = len(token_ids) - 1
                for member in [request, *output.forks.get(request.request_id, ())]:
                    sample_rows.append(row)
                    sample_requests.append(member)
        device = self.device
        meta = AttentionMetadata(
            block_size=size,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            num_decode_tokens=len(decodes),
            decode_block_tables=_pad_tables([s.block_ids for s in decodes], device),
            decode_seq_lens=torch.tensor(
                [s.request.num_computed_tokens + 1 for s in decodes],
                dtype=torch.int64,
                device=device,
            ),
            prefill_query_lens=[s.num_query_tokens for s in prefills],
            prefill_seq_lens=[_context_after(s) for s in prefills],
            prefill_block_tables=_pad_tables([s.block_ids for s in prefills], device),
        )
        lora = None
        if slot_of:
            lora = LoRABatch.from_runs(
                slot_runs, len(decodes), device, self.lora_slots.slot_ranks()
            )
        slot_writes = self.lora_slots.take_loads() if self.lora_slots is not None else []
        inputs = StepInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            meta=meta,
            lora=lora,
            sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=device),
            block_copies=tuple(output.block_copies),
            slot_writes=tuple(slot_writes),
            prompt_rows=_prompt_rows(prompt_owners, prompt_rows, prompt_targets, device),
            pool_rows=PoolRows(
                rows=torch.tensor(pool_rows, dtype=torch.int64, device=device),
                owners=torch.tensor(pool_owner_of_row, dtype=torch.int64, device=device),
                count=len(pool_owners),
            )
            if pool_owners
            else None,
        )
        return PreparedStep(inputs, sample_requests, drafts, prompt_owners, pool_owners)


def _prompt_rows(
    owners: list[tuple[Request, range]],
    rows: list[int],
    targets: list[int],
    device: torch.device,
) -> PromptRows | None:
    if not rows:
        return None
    return PromptRows(
        rows=torch.tensor(rows, dtype=torch.int64, device=device),
        targets=torch.tensor(targets, dtype=torch.int64, device=device),
        top_k=max(request.sampling_params.prompt_logprobs or 0 for request, _ in owners),
    )


def _book_prompt_scores(
    result: StepResult, scores: PromptScores, owners: list[tuple[Request, range]]
) -> None:
    """Adds the step's prompt Logprobs to `result`; a request whose prompt logits were
    not finite fails instead (and keeps no token it sampled this step)."""
    booked, broken = book_scores(scores, owners)
    result.prompt_logprobs.update(booked)
    for request in broken:
        logger.warning("request %s: non-finite logits at a prompt position", request.request_id)
        result.sampled.pop(request.request_id, None)
        result.failed[request.request_id] = _non_finite(request)


def _row_failure(request: Request, sampled: SamplerOutput, row: int) -> RequestFailure | None:
    """Why `row` of `sampled` gives `request` no token (None: it gives one); a guided
    request's grammar takes the token here."""
    if row in sampled.blocked_rows:
        return _no_token_fits(request)
    if row in sampled.invalid_rows:
        return _non_finite(request)
    if request.grammar is not None and not _grammar_takes(request.grammar, sampled.token_ids[row]):
        return _no_token_fits(request)
    return None


def _grammar_takes(grammar: GuidedState, token: int) -> bool:
    try:
        return grammar.accept_token(token)
    except Exception:
        logger.exception("the grammar matcher failed on token %d", token)
        return False


def _no_token_fits(request: Request) -> RequestFailure:
    """No token of this model's vocabulary continues the requested structure (the
    request's own doing: a regex or schema this tokenizer cannot spell)."""
    logger.warning("request %s: no token can continue its grammar", request.request_id)
    return RequestFailure(
        "no token of this model's vocabulary can continue the requested structured output",
        client_fault=True,
    )


def _non_finite(request: Request) -> RequestFailure:
    if request.lora is not None:
        return RequestFailure(
            f"adapter {request.lora.name!r} produced non-finite logits (NaN or Inf); "
            "its weights cannot be served",
            client_fault=True,
        )
    return RequestFailure("the model produced non-finite logits (NaN or Inf)")


def _context_after(item: ScheduledRequest) -> int:
    return item.request.num_computed_tokens + item.num_query_tokens
