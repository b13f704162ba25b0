"""Offline throughput benchmark: our engine against HF transformers `generate`.

The workload is fixed and seeded: `num_requests` prompts of exactly `prompt_len` random
token ids drawn from the tokenizer's ordinary (non-special) ids, each generating
exactly `output_len` tokens greedily with EOS ignored. Both sides run in this process
with the same dtype and torch thread count; only generation is timed.
"""

from __future__ import annotations

import json
import os
import platform
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from loraplex.platform.config import parse_dtype
from loraplex.platform.model_files import resolve_model_folder
from loraplex.platform.request import SamplingParams

WARMUP_REQUESTS = 2
WARMUP_TOKENS = 4


@dataclass(frozen=True)
class Workload:
    """Prompts as token id lists, all generating exactly `output_len` tokens."""

    prompts: list[list[int]]
    output_len: int

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def total_output_tokens(self) -> int:
        return self.num_requests * self.output_len


@dataclass(frozen=True)
class RunResult:
    """One side's timed run: how many tokens it generated in how long."""

    name: str
    num_requests: int
    output_tokens: int
    elapsed_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s > 0 else float("inf")


@dataclass(frozen=True)
class MachineInfo:
    cpu_count: int
    usable_cores: int
    torch_threads: int
    torch_version: str
    processor: str

    @classmethod
    def collect(cls) -> MachineInfo:
        return cls(
            cpu_count=os.cpu_count() or 0,
            usable_cores=len(os.sched_getaffinity(0)),
            torch_threads=torch.get_num_threads(),
            torch_version=torch.__version__,
            processor=platform.processor() or platform.machine(),
        )


@dataclass
class BenchReport:
    """Everything `format_report` prints."""

    model: str
    dtype: str
    workload: Workload
    machine: MachineInfo
    load_before: str
    load_after: str = ""
    results: list[RunResult] = field(default_factory=list)


def read_loadavg() -> str:
    """The first three fields of /proc/loadavg (1, 5, 15 minute), or 'n/a'."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def normal_token_ids(tokenizer, vocab_size: int) -> list[int]:
    """Ids below both the tokenizer's and the model's vocabulary size that are not special."""
    special = set(getattr(tokenizer, "all_special_ids", ()))
    limit = min(vocab_size, len(tokenizer))
    return [i for i in range(limit) if i not in special]


def build_workload(
    token_pool: Sequence[int], num_requests: int, prompt_len: int, output_len: int, seed: int = 0
) -> Workload:
    """Seeded random prompts of exactly `prompt_len` ids drawn from `token_pool`."""
    if num_requests < 1 or prompt_len < 1 or output_len < 1:
        raise ValueError("num_requests, prompt_len and output_len must all be >= 1")
    if not token_pool:
        raise ValueError("token_pool is empty")
    rng = random.Random(seed)
    prompts = [rng.choices(token_pool, k=prompt_len) for _ in range(num_requests)]
    return Workload(prompts=prompts, output_len=output_len)


def model_vocab_size(folder: Path) -> int:
    return int(json.loads((Path(folder) / "config.json").read_text())["vocab_size"])


def timed(name: str, workload: Workload, run: Callable[[], int]) -> RunResult:
    """Times `run` (which returns the number of tokens it generated)."""
    started = time.perf_counter()
    tokens = run()
    elapsed = time.perf_counter() - started
    if tokens != workload.total_output_tokens:
        raise RuntimeError(
            f"{name} generated {tokens} tokens, expected {workload.total_output_tokens}"
        )
    return RunResult(name, workload.num_requests, tokens, elapsed)


def fixed_length_params(output_len: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)


def run_engine(llm, workload: Workload, use_tqdm: bool = True) -> RunResult:
    """Warms the engine up on a few short requests (untimed), then times the workload."""
    llm.generate(
        workload.prompts[:WARMUP_REQUESTS],
        fixed_length_params(min(WARMUP_TOKENS, workload.output_len)),
    )

    def run() -> int:
        outputs = llm.generate(
            workload.prompts, fixed_length_params(workload.output_len), use_tqdm=use_tqdm
        )
        return sum(len(output.token_ids) for output in outputs)

    return timed("loraplex", workload, run)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask for a batch, padded on the left to the longest prompt."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if prompt:
            input_ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
    return input_ids, mask


def load_hf_model(folder: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
    return model.eval()


def hf_generate_batch(model, prompts: Sequence[Sequence[int]], output_len: int) -> int:
    """Greedy HF generate of exactly `output_len` new tokens per prompt; returns the count."""
    pad_id = model.config.pad_token_id
    pad_id = 0 if pad_id is None else int(pad_id)
    input_ids, mask = left_pad(prompts, pad_id)
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            pad_token_id=pad_id,
        )
    return (out.shape[1] - input_ids.shape[1]) * out.shape[0]


def run_hf(
    folder: Path, workload: Workload, dtype: torch.dtype, batch_size: int, use_tqdm: bool = True
) -> RunResult:
    """HF transformers baseline over static batches of `batch_size` (left padded)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    model = load_hf_model(folder, dtype)
    hf_generate_batch(
        model, workload.prompts[:WARMUP_REQUESTS], min(WARMUP_TOKENS, workload.output_len)
    )
    batches = [
        workload.prompts[start : start + batch_size]
        for start in range(0, workload.num_requests, batch_size)
    ]

    def run() -> int:
        tokens = 0
        with tqdm(total=workload.num_requests, disable=not use_tqdm, desc="hf generate") as bar:
            for batch in batches:
                tokens += hf_generate_batch(model, batch, workload.output_len)
                bar.update(len(batch))
        return tokens

    return timed("hf", workload, run)


def run_offline_bench(
    model: str,
    dtype: str,
    num_requests: int,
    prompt_len: int,
    output_len: int,
    baseline: str | None = None,
    hf_batch_size: int = 16,
    seed: int = 0,
    engine_options: dict[str, object] | None = None,
) -> BenchReport:
    """Builds the workload, runs our engine and optionally the HF baseline."""
    from loraplex.platform.llm import LLM

    torch_dtype = parse_dtype(dtype)
    folder = resolve_model_folder(model)
    report = BenchReport(
        model=model,
        dtype=str(torch_dtype).removeprefix("torch."),
        workload=Workload([], output_len),
        machine=MachineInfo.collect(),
        load_before=read_loadavg(),
    )
    llm = LLM(model=str(folder), dtype=torch_dtype, seed=seed, **(engine_options or {}))
    pool = normal_token_ids(llm.tokenizer, model_vocab_size(folder))
    report.workload = build_workload(pool, num_requests, prompt_len, output_len, seed)
    report.results.append(run_engine(llm, report.workload))
    del llm
    if baseline == "hf":
        report.results.append(run_hf(folder, report.workload, torch_dtype, hf_batch_size))
    elif baseline is not None:
        raise ValueError(f"unknown baseline {baseline!r}; the only one is 'hf'")
    report.load_after = read_loadavg()
    return report


def format_report(report: BenchReport) -> str:
    """Human-readable summary: machine, workload, tokens/s per side, ratio ours/hf."""
    w, m = report.workload, report.machine
    lines = [
        f"machine: {m.processor}, {m.cpu_count} cpus ({m.usable_cores} usable), "
        f"torch {m.torch_version} with {m.torch_threads} threads",
        f"model: {report.model} ({report.dtype})",
        f"workload: {w.num_requests} requests x {len(w.prompts[0]) if w.prompts else 0} "
        f"prompt tokens -> {w.output_len} output tokens (greedy, ignore_eos)",
        f"loadavg before: {report.load_before}",
    ]
    for result in report.results:
        lines.append(
            f"{result.name:>9}: {result.output_tokens} tokens in {result.elapsed_s:.2f}s = "
            f"{result.tokens_per_s:.1f} generated tokens/s"
        )
    by_name = {result.name: result for result in report.results}
    if "loraplex" in by_name and "hf" in by_name:
        ratio = by_name["loraplex"].tokens_per_s / by_name["hf"].tokens_per_s
        lines.append(f"ratio ours/hf: {ratio:.2f}x")
    lines.append(f"loadavg after: {report.load_after}")
    return "\n".join(lines) + "\n"
