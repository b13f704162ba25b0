"""`loraplex bench offline --host-overhead`: the engine's host time per step outside its
kernels, at batch 1 and at a full batch, in µs per step and per layer.

Per batch size B, B prompts of `prompt_len` tokens each generate exactly `output_len`
tokens (greedy, EOS ignored), after one warm-up run, `rounds` times:

    step      wall time of the run over its engine steps, torch's profiler off
    kernels   time inside torch operators per step (the model's matmuls, attention,
              norms, the native CPU ops, sampling, copies), with the profiler on: the
              summed CPU time of every operator called from Python (one not called
              inside another operator)
    host      the profiled run's wall time per step - kernels: Python in the
              scheduler, the runner's input building, the model's modules between
              operators, sampling's bookkeeping and the output processing

Each figure is the median over the rounds. Host and kernel time come from the same
run: taken from two runs, their difference drowns in a VM's drift between runs. The
profiler's cost per operator falls partly outside the operators, so `host` includes
a little of it. On a GPU the kernels run asynchronously and these figures mean
nothing: it refuses to run there.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from torch.profiler import ProfilerActivity, profile

from loraplex.platform.config import parse_dtype_option
from loraplex.platform.model_files import resolve_model_folder
from loraplex.tools.engine_bench.offline import (
    MachineInfo,
    build_workload,
    fixed_length_params,
    model_vocab_size,
    normal_token_ids,
    read_loadavg,
)


@dataclass(frozen=True)
class HostOverhead:
    """One batch size's figures, per engine step."""

    batch: int
    steps: int
    step_us: float
    kernel_us: float
    host_us: float
    num_layers: int

    @property
    def host_us_per_layer(self) -> float:
        return self.host_us / self.num_layers


@dataclass
class HostReport:
    model: str
    dtype: str
    prompt_len: int
    output_len: int
    rounds: int
    machine: MachineInfo
    load_before: str
    load_after: str = ""
    rows: list[HostOverhead] = field(default_factory=list)


def _run(llm, prompts: list[list[int]], output_len: int) -> int:
    """Generates for `prompts` step by step; returns the number of engine steps."""
    engine = llm.engine
    params = fixed_length_params(output_len)
    for index, prompt in enumerate(prompts):
        engine.add_group(engine.make_request_group(f"host-{index}", prompt, params))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return steps


def operator_seconds(run) -> tuple[int, float, float]:
    """Runs `run()` (returning a step count) under torch's CPU profiler: (steps, its
    wall seconds, seconds inside operators called from Python)."""
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        started = time.perf_counter()
        steps = run()
        wall = time.perf_counter() - started
    total_us = sum(
        event.cpu_time_total
        for event in profiler.events()
        if event.cpu_parent is None and not event.is_user_annotation
    )
    return steps, wall, total_us / 1e6


def measure(llm, prompts: list[list[int]], output_len: int, rounds: int) -> HostOverhead:
    """`rounds` timed runs and `rounds` profiled runs of `prompts`, alternating."""
    _run(llm, prompts, output_len)
    step_s, kernel_s, host_s = [], [], []
    steps = 0
    for _ in range(rounds):
        started = time.perf_counter()
        steps = _run(llm, prompts, output_len)
        step_s.append((time.perf_counter() - started) / steps)
        profiled_steps, wall, inside = operator_seconds(lambda: _run(llm, prompts, output_len))
        kernel_s.append(inside / profiled_steps)
        host_s.append((wall - inside) / profiled_steps)
    return HostOverhead(
        batch=len(prompts),
        steps=steps,
        step_us=statistics.median(step_s) * 1e6,
        kernel_us=statistics.median(kernel_s) * 1e6,
        host_us=statistics.median(host_s) * 1e6,
        num_layers=llm.engine.arch.num_layers,
    )


def run_host_bench(
    model: str,
    dtype: str,
    batches: tuple[int, ...],
    prompt_len: int,
    output_len: int,
    rounds: int,
    seed: int = 0,
    engine_options: dict[str, object] | None = None,
) -> HostReport:
    from loraplex.platform.llm import LLM

    folder = resolve_model_folder(model)
    options = {"max_num_seqs": max(batches), **(engine_options or {})}
    llm = LLM(model=str(folder), dtype=parse_dtype_option(dtype), seed=seed, **options)
    if llm.engine.device.type != "cpu":
        raise ValueError("--host-overhead measures the CPU engine (GPU kernels run async)")
    report = HostReport(
        model=model,
        dtype=str(llm.engine.config.model.dtype).removeprefix("torch."),
        prompt_len=prompt_len,
        output_len=output_len,
        rounds=rounds,
        machine=MachineInfo.collect(),
        load_before=read_loadavg(),
    )
    pool = normal_token_ids(llm.tokenizer, model_vocab_size(folder))
    for batch in batches:
        workload = build_workload(pool, batch, prompt_len, output_len, seed)
        report.rows.append(measure(llm, workload.prompts, output_len, rounds))
    report.load_after = read_loadavg()
    return report


def format_host_report(report: HostReport) -> str:
    machine = report.machine
    lines = [
        f"model {report.model} ({report.dtype}), {report.prompt_len} -> {report.output_len} "
        f"tokens per request, median of {report.rounds} rounds",
        f"cpu: {machine.processor}, {machine.usable_cores} usable cores, torch "
        f"{machine.torch_version} on {machine.torch_threads} threads; "
        f"loadavg {report.load_before} -> {report.load_after}",
        "",
        "| batch | steps | step (us) | kernels (us) | host (us/step) | host (us/layer) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report.rows:
        lines.append(
            f"| {row.batch} | {row.steps} | {row.step_us:,.0f} | {row.kernel_us:,.0f} | "
            f"{row.host_us:,.0f} | {row.host_us_per_layer:,.1f} |"
        )
    return "\n".join(lines) + "\n"
