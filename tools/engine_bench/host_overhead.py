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

Where the engine runs its layers as one native call (platform/models/native_stack.py),
each round also runs the same requests through the model's Python layer loop, in the
same engine, alternating (stack, loop, stack, loop, ...): the report gives both paths
and the loop/stack ratios. Inside the stack the operators are called from C++, so the
stack's own cost between them counts as kernel time.
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

NATIVE_STACK = "native stack"
PYTHON_LOOP = "python loop"


@dataclass(frozen=True)
class HostOverhead:
    """One batch size's figures on one path, per engine step."""

    batch: int
    path: str
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


@dataclass
class _Samples:
    step_s: list[float] = field(default_factory=list)
    kernel_s: list[float] = field(default_factory=list)
    host_s: list[float] = field(default_factory=list)
    steps: int = 0


def _sample(llm, prompts: list[list[int]], output_len: int, into: _Samples) -> None:
    """One timed run and one profiled run of `prompts`."""
    started = time.perf_counter()
    into.steps = _run(llm, prompts, output_len)
    into.step_s.append((time.perf_counter() - started) / into.steps)
    profiled_steps, wall, inside = operator_seconds(lambda: _run(llm, prompts, output_len))
    into.kernel_s.append(inside / profiled_steps)
    into.host_s.append((wall - inside) / profiled_steps)


def measure(llm, prompts: list[list[int]], output_len: int, rounds: int) -> list[HostOverhead]:
    """Per path (the native stack where the engine has one, and the Python loop),
    `rounds` timed and `rounds` profiled runs of `prompts`, the paths alternating."""
    model = llm.engine.runner.model
    stack = model.native_stack
    paths = {NATIVE_STACK: stack, PYTHON_LOOP: None} if stack is not None else {PYTHON_LOOP: None}
    samples = {path: _Samples() for path in paths}
    try:
        for runs_with in paths.values():
            model.native_stack = runs_with
            _run(llm, prompts, output_len)
        for _ in range(rounds):
            for path, runs_with in paths.items():
                model.native_stack = runs_with
                _sample(llm, prompts, output_len, samples[path])
    finally:
        model.native_stack = stack
    return [
        HostOverhead(
            batch=len(prompts),
            path=path,
            steps=got.steps,
            step_us=statistics.median(got.step_s) * 1e6,
            kernel_us=statistics.median(got.kernel_s) * 1e6,
            host_us=statistics.median(got.host_s) * 1e6,
            num_layers=llm.engine.arch.num_layers,
        )
        for path, got in samples.items()
    ]


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
        report.rows += measure(llm, workload.prompts, output_len, rounds)
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
        "| batch | path | steps | step (us) | kernels (us) | host (us/step) | host (us/layer) |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in report.rows:
        lines.append(
            f"| {row.batch} | {row.path} | {row.steps} | {row.step_us:,.0f} | "
            f"{row.kernel_us:,.0f} | {row.host_us:,.0f} | {row.host_us_per_layer:,.1f} |"
        )
    by_key = {(row.batch, row.path): row for row in report.rows}
    ratios = []
    for (batch, path), stack in by_key.items():
        loop = by_key.get((batch, PYTHON_LOOP))
        if path == NATIVE_STACK and loop is not None:
            ratios.append(
                f"batch {batch}: host {stack.host_us / loop.host_us:.2f}x the loop's, "
                f"step {stack.step_us / loop.step_us:.2f}x"
            )
    if ratios:
        lines += ["", "native stack against the python loop, same engine, alternating: "]
        lines[-1] += "; ".join(ratios)
    return "\n".join(lines) + "\n"
