"""The throughput this machine's GEMMs allow for a workload, and `dtype: auto`.

A fixed workload (N prompts of P tokens, each generating exactly O tokens) runs as a
sequence of engine steps. `ideal_schedule` replays the scheduler's policy for it
(running requests first, then admissions, under `max_num_batched_tokens` and
`max_num_seqs`, chunked prefill, no KV-cache limit) and records each step's rows: the
tokens through the per-layer projections and the sampled rows through the LM head.
The ceiling is the time those projections alone take at the probed GEMM rates
(`gemm_probe`): attention, norms, sampling and every other cost count as zero, so no
engine can beat it on this machine with these matmuls, and `engine tok/s / ceiling
tok/s` is the engine's share of what the hardware allows.

`measure_dtype` (what `loraplex probe dtype` records for `dtype: auto`,
platform/dtype_choice.py) picks, among the dtypes with a native matmul on this CPU, the
one whose projections finish the reference workload (64 x 128 -> 64 under the engine's
limits) first, from a quick probe of one decode and one prefill row count; a half
dtype must beat fp32 by `HALF_MARGIN`, because fp32 is the more accurate of two
near-equal choices.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.platform.arch import ModelArch
from loraplex.platform.config import SchedulerConfig
from loraplex.platform.dtype_choice import record_path, write_record
from loraplex.tools.engine_bench.gemm_probe import (
    GemmTimes,
    Projection,
    QuantizedProduct,
    candidate_dtypes,
    dtype_name,
    model_projections,
    probe_gemm_times,
    product_name,
)

logger = logging.getLogger(__name__)

HALF_MARGIN = 0.05
"""bf16 / fp16 is chosen over fp32 only when its ceiling time is this much lower."""


@dataclass(frozen=True)
class FixedWorkload:
    """`num_requests` prompts of `prompt_len` tokens, each generating `output_len`."""

    num_requests: int
    prompt_len: int
    output_len: int

    @property
    def output_tokens(self) -> int:
        return self.num_requests * self.output_len


REFERENCE_WORKLOAD = FixedWorkload(num_requests=64, prompt_len=128, output_len=64)
"""W1: what `dtype: auto` optimizes for and the served and offline figures of docs/benchmarks.md run."""


@dataclass(frozen=True)
class StepRows:
    """One engine step: `tokens` rows through every layer, `sampled` through the LM head."""

    tokens: int
    sampled: int


def ideal_schedule(workload: FixedWorkload, scheduler: SchedulerConfig) -> list[StepRows]:
    """The steps the engine's FCFS policy runs for `workload` when KV blocks never run
    out and every request arrives at once (see Scheduler.schedule)."""
    prompt, out = workload.prompt_len, workload.output_len
    waiting = list(range(workload.num_requests))
    computed: dict[int, int] = {}
    generated: dict[int, int] = {}
    running: list[int] = []
    steps: list[StepRows] = []
    while waiting or running:
        budget = scheduler.max_num_batched_tokens
        chunks: list[tuple[int, int]] = []
        for request in running:
            want = prompt + generated[request] - computed[request]
            take = min(want, budget) if scheduler.enable_chunked_prefill else want
            if take <= 0 or take > budget:
                continue
            chunks.append((request, take))
            budget -= take
        while waiting and budget > 0 and len(running) < scheduler.max_num_seqs:
            take = min(prompt, budget) if scheduler.enable_chunked_prefill else prompt
            if take > budget:
                break
            request = waiting.pop(0)
            running.append(request)
            computed[request], generated[request] = 0, 0
            chunks.append((request, take))
            budget -= take
        if not chunks:
            raise ValueError(
                f"a {prompt}-token prompt never fits a {scheduler.max_num_batched_tokens}-token "
                "step without chunked prefill"
            )
        sampled = 0
        for request, take in chunks:
            computed[request] += take
            if computed[request] == prompt + generated[request]:
                generated[request] += 1
                sampled += 1
                if generated[request] == out:
                    running.remove(request)
        steps.append(StepRows(sum(take for _, take in chunks), sampled))
    return steps


def probe_rows(
    projections: tuple[Projection, ...], steps: list[StepRows]
) -> dict[str, tuple[int, ...]]:
    """The row counts each projection runs at over `steps`."""
    token_rows = tuple(sorted({s.tokens for s in steps}))
    sampled_rows = tuple(sorted({s.sampled for s in steps if s.sampled}))
    return {p.name: token_rows if p.per_layer else sampled_rows for p in projections}


def ceiling_seconds(
    projections: tuple[Projection, ...], steps: list[StepRows], times: GemmTimes
) -> float:
    """Seconds the projections of `steps` take at the probed rates."""
    total = 0.0
    for step in steps:
        for projection in projections:
            rows = step.tokens if projection.per_layer else step.sampled
            if rows:
                total += projection.count * times.time(projection.name, rows)
    return total


@dataclass(frozen=True)
class Ceiling:
    """The GEMM-bound ceiling of one workload in one dtype."""

    dtype: str
    num_threads: int
    workload: FixedWorkload
    num_steps: int
    seconds: float
    times: GemmTimes

    @property
    def tokens_per_s(self) -> float:
        return self.workload.output_tokens / self.seconds

    def share(self, engine_tokens_per_s: float) -> float:
        """The engine's throughput as a fraction of this ceiling."""
        return engine_tokens_per_s / self.tokens_per_s


def measure_ceiling(
    arch: ModelArch,
    dtype: torch.dtype,
    workload: FixedWorkload,
    scheduler: SchedulerConfig,
    *,
    use_cache: bool = True,
    quantization: QuantizedProduct | None = None,
) -> Ceiling:
    """Probes (or reads the cached probe of) the projections `workload` runs in `dtype`
    (with `quantization`, the decoder layers' in int8: gemm_probe.py) with torch's
    current thread count, on the calling thread."""
    projections = model_projections(arch)
    steps = ideal_schedule(workload, scheduler)
    times = probe_gemm_times(
        projections,
        probe_rows(projections, steps),
        dtype,
        use_cache=use_cache,
        quantization=quantization,
    )
    return Ceiling(
        dtype=product_name(dtype, quantization),
        num_threads=times.num_threads,
        workload=workload,
        num_steps=len(steps),
        seconds=ceiling_seconds(projections, steps, times),
        times=times,
    )


QUICK_PROBE_S = 0.01
"""`dtype: auto` times each projection for this long per window: it compares dtypes,
which differ by far more than the noise this leaves."""
QUICK_PREFILL_ROWS = 512
"""`dtype: auto` times prefill at up to this many rows and scales linearly (a GEMM is
compute-bound well before it)."""


def step_mix_seconds(
    arch: ModelArch, dtype: torch.dtype, workload: FixedWorkload, scheduler: SchedulerConfig
) -> float:
    """A quick estimate of `workload`'s projection time in `dtype`: its prompt tokens in
    prefill steps of up to QUICK_PREFILL_ROWS rows and its decodes in steps of the whole
    batch, each timed at that one row count (two rows per projection instead of every
    row count of the ideal schedule)."""
    projections = model_projections(arch)
    prefill_rows = min(
        QUICK_PREFILL_ROWS,
        scheduler.max_num_batched_tokens,
        workload.num_requests * workload.prompt_len,
    )
    decode_rows = min(scheduler.max_num_seqs, workload.num_requests)
    rows = {
        p.name: (decode_rows, prefill_rows) if p.per_layer else (decode_rows,) for p in projections
    }
    times = probe_gemm_times(projections, rows, dtype, min_timed_s=QUICK_PROBE_S)
    prefill_steps = workload.num_requests * workload.prompt_len / prefill_rows
    decode_steps = workload.num_requests * (workload.output_len - 1) / decode_rows
    sampled_steps = workload.output_tokens / decode_rows
    total = 0.0
    for p in projections:
        if p.per_layer:
            total += p.count * (
                prefill_steps * times.time(p.name, prefill_rows)
                + decode_steps * times.time(p.name, decode_rows)
            )
        else:
            total += sampled_steps * times.time(p.name, decode_rows)
    return total


def measure_dtype(
    arch: ModelArch, scheduler: SchedulerConfig
) -> tuple[torch.dtype, dict[str, float]]:
    """The CPU dtype whose projections finish the reference workload first by
    `step_mix_seconds` (a half dtype must beat fp32 by HALF_MARGIN), and each candidate's
    seconds. Probes on the calling thread with its torch thread count (GEMM times are
    cached per machine, shape and thread count)."""
    seconds = {
        dtype: step_mix_seconds(arch, dtype, REFERENCE_WORKLOAD, scheduler)
        for dtype in candidate_dtypes(torch.device("cpu"))
    }
    best = min(seconds, key=seconds.__getitem__)
    if seconds[best] > seconds[torch.float32] * (1 - HALF_MARGIN):
        best = torch.float32
    return best, {dtype_name(d): s for d, s in seconds.items()}


def record_dtype(arch: ModelArch, scheduler: SchedulerConfig) -> tuple[torch.dtype, Path]:
    """`loraplex probe dtype`: measures the choice and records it where an engine with
    `dtype: auto` on this machine reads it (platform/dtype_choice.py)."""
    best, seconds = measure_dtype(arch, scheduler)
    path = record_path(arch, torch.get_num_threads())
    write_record(path, best, seconds)
    logger.info(
        "dtype auto -> %s (projection time of 64 x 128 -> 64 on %d threads: %s), recorded in %s",
        dtype_name(best),
        torch.get_num_threads(),
        ", ".join(f"{name} {s:.2f}s" for name, s in seconds.items()),
        path,
    )
    return best, path
