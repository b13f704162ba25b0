"""Offline throughput benchmark: our engine against HF transformers `generate`.

The workload is fixed and seeded: `num_requests` prompts of exactly `prompt_len` random
token ids drawn from the tokenizer's ordinary (non-special) ids, each generating
exactly `output_len` tokens greedily with EOS ignored. Both sides run in this process
with the same dtype and torch thread count; only generation is timed.

With `adapters=N` the bench writes N seeded random PEFT LoRA adapters for the model into
a temporary folder and times three runs of the same workload: the engine with every
request on the base model ("base"), the engine with the requests spread round-robin
over the N adapters ("lora"), and, with the HF baseline, HF transformers + PEFT serving
the requests grouped by adapter in static batches ("hf+peft"). Adapters are read from
disk into host memory before timing on both sides; copying them into the engine's
device slots is part of serving and is timed. The engine's warm-up there is one step's
token budget of prompts outside the workload (see `warmup_request_count`).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import platform
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from loraplex.adapters.peft_format import SUPPORTED_MODULES
from loraplex.platform.config import QUANTIZATIONS, dtype_name, parse_dtype_option
from loraplex.platform.model_files import resolve_model_folder
from loraplex.platform.models.compressed_tensors import (
    INT4_MODE,
    read_checkpoint_quantization,
    read_int4_scheme,
)
from loraplex.platform.request import SamplingParams
from loraplex.tools.engine_bench.ceiling import Ceiling, FixedWorkload, measure_ceiling
from loraplex.tools.engine_bench.gemm_probe import INT4, QuantizedProduct, candidate_dtypes

logger = logging.getLogger(__name__)

WARMUP_REQUESTS = 2
WARMUP_TOKENS = 4

HF_BATCH_SIZE = 16
"""Static batch size of the plain HF baseline (base model only)."""
HF_PEFT_BATCH_SIZE = 8
"""Static batch size of the HF + PEFT baseline, whose batches hold one adapter each."""
ADAPTER_STD = 0.02
"""Std of the bench adapters' random A and B: a visible but small delta."""
BASE_RUN, LORA_RUN, HF_PEFT_RUN = "base", "lora", "hf+peft"
LORA_TARGET_ALIASES = {name.removesuffix("_proj"): name for name in SUPPORTED_MODULES}
"""Short target names ('q', 'gate', ...) -> PEFT module names ('q_proj', 'gate_proj', ...)."""


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


def cpu_model() -> str:
    """/proc/cpuinfo's first 'model name' (the CPU kind a figure was taken on), or what
    `platform` knows where there is no such file."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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
            processor=cpu_model(),
        )


@dataclass(frozen=True)
class LoRABenchSetup:
    """How a bench with adapters was set up (what `format_report` says about it)."""

    num_adapters: int
    rank: int
    targets: tuple[str, ...]
    max_loras: int
    hf_batch_size: int
    warmup_requests: int


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
    lora: LoRABenchSetup | None = None
    ceilings: list[Ceiling] = field(default_factory=list)
    """With `ceiling`: the engine's dtype first, then the other dtypes this CPU runs."""

    def ceiling_share(self) -> float | None:
        """The engine's tok/s over its own dtype's ceiling (None without a ceiling)."""
        if not self.ceilings or not self.results:
            return None
        return self.ceilings[0].share(self.results[0].tokens_per_s)

    def ratios(self) -> dict[str, float]:
        """Throughput ratios between the runs present: 'ours/hf' for the base-only bench,
        'lora/base' and 'lora/hf+peft' for the bench with adapters."""
        by_name = {result.name: result.tokens_per_s for result in self.results}
        pairs = [("loraplex", "hf"), (LORA_RUN, BASE_RUN), (LORA_RUN, HF_PEFT_RUN)]
        return {
            f"{'ours' if top == 'loraplex' else top}/{bottom}": by_name[top] / by_name[bottom]
            for top, bottom in pairs
            if top in by_name and bottom in by_name
        }


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


def run_engine(
    llm,
    workload: Workload,
    use_tqdm: bool = True,
    *,
    name: str = "loraplex",
    adapters: Sequence[str | None] | None = None,
    warmup_prompts: Sequence[Sequence[int]],
    warmup_adapter: str | None = None,
) -> RunResult:
    """Warms the engine up on a few short requests (untimed), then times the workload.

    `adapters` gives each request's adapter (None: all on the base model); the warm-up
    requests use `warmup_adapter`. `warmup_prompts` must not be workload prompts: those
    would leave prefix-cache hits for the timed run."""
    warmup_prompts = list(warmup_prompts)
    warmup_params = fixed_length_params(min(WARMUP_TOKENS, workload.output_len))
    if adapters is None:
        llm.generate(warmup_prompts, warmup_params)
    else:
        llm.generate(warmup_prompts, warmup_params, adapters=[warmup_adapter] * len(warmup_prompts))
    adapter_args = {} if adapters is None else {"adapters": list(adapters)}

    def run() -> int:
        outputs = llm.generate(
            workload.prompts,
            fixed_length_params(workload.output_len),
            use_tqdm=use_tqdm,
            **adapter_args,
        )
        return sum(len(output.token_ids) for output in outputs)

    return timed(name, workload, run)


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
    input_ids, mask = (t.to(model.device) for t in left_pad(prompts, pad_id))
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


def parse_lora_targets(spec: str | Sequence[str]) -> tuple[str, ...]:
    """'q,k,v,o,gate,up,down' (short or PEFT names, comma separated or a sequence) -> the
    PEFT module names in canonical order; an unknown or empty spec is a ValueError."""
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    wanted = set()
    for raw in names:
        name = raw.strip()
        module = LORA_TARGET_ALIASES.get(name, name)
        if module not in SUPPORTED_MODULES:
            known = ", ".join(LORA_TARGET_ALIASES)
            raise ValueError(f"unknown LoRA target {name!r}; use some of {known}")
        wanted.add(module)
    if not wanted:
        raise ValueError("no LoRA targets given")
    return tuple(module for module in SUPPORTED_MODULES if module in wanted)


def default_hf_batch_size(num_adapters: int) -> int:
    """16 for the plain HF baseline, 8 for HF + PEFT (batches grouped by adapter)."""
    return HF_PEFT_BATCH_SIZE if num_adapters > 0 else HF_BATCH_SIZE


def make_bench_adapters(
    folder: Path,
    out_dir: Path,
    names: Sequence[str],
    rank: int,
    targets: Sequence[str],
    seed: int = 0,
    std: float = ADAPTER_STD,
) -> dict[str, Path]:
    """Saves one real PEFT LoRA adapter per name under `out_dir` for the HF model in
    `folder`: A and B seeded random with `std` (PEFT starts B at zero, a no-op), alpha
    = 2 * rank. Returns name -> adapter folder."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=list(targets),
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(load_hf_model(folder, torch.float32), config)
    lora_params = [param for name, param in model.named_parameters() if "lora_" in name]
    folders: dict[str, Path] = {}
    for index, name in enumerate(names):
        generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
        with torch.no_grad():
            for param in lora_params:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
        folders[name] = Path(out_dir) / name
        model.save_pretrained(folders[name])
    logger.info(
        "wrote %d rank-%d adapters on %s into %s", len(names), rank, ",".join(targets), out_dir
    )
    return folders


def warmup_request_count(token_budget: int, prompt_len: int, num_requests: int) -> int:
    """Warm-up requests for the engine runs: enough prompts to fill one step's
    token budget (at most the workload's size), so the process's first full-size step,
    which is much slower than later ones (first use of its large activation buffers),
    is not timed in whichever run goes first."""
    fill = -(-token_budget // prompt_len)
    return max(WARMUP_REQUESTS, min(num_requests, fill))


def spread_over(names: Sequence[str], num_requests: int) -> list[str]:
    """Request i -> names[i % len(names)] (round-robin)."""
    if not names:
        raise ValueError("no adapters to spread the requests over")
    return [names[i % len(names)] for i in range(num_requests)]


def run_hf_peft(
    folder: Path,
    workload: Workload,
    dtype: torch.dtype,
    adapter_folders: dict[str, Path],
    request_adapters: Sequence[str],
    batch_size: int = HF_PEFT_BATCH_SIZE,
    use_tqdm: bool = True,
) -> RunResult:
    """HF transformers + PEFT baseline: every adapter loaded (unmerged) into one PeftModel
    before timing, requests grouped by adapter (in order of first use) into static left
    padded batches of `batch_size`, `set_adapter` before each group."""
    from peft import PeftModel

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if len(request_adapters) != workload.num_requests:
        raise ValueError(f"{len(request_adapters)} adapters for {workload.num_requests} requests")
    order = list(dict.fromkeys(request_adapters))
    model = PeftModel.from_pretrained(
        load_hf_model(folder, dtype), adapter_folders[order[0]], adapter_name=order[0]
    )
    for name in order[1:]:
        model.load_adapter(adapter_folders[name], adapter_name=name)
    model.eval()
    groups: dict[str, list[list[int]]] = {name: [] for name in order}
    for prompt, name in zip(workload.prompts, request_adapters, strict=True):
        groups[name].append(prompt)
    batches = [
        (name, prompts[start : start + batch_size])
        for name, prompts in groups.items()
        for start in range(0, len(prompts), batch_size)
    ]
    model.set_adapter(order[0])
    hf_generate_batch(
        model, workload.prompts[:WARMUP_REQUESTS], min(WARMUP_TOKENS, workload.output_len)
    )

    def run() -> int:
        tokens = 0
        with tqdm(total=workload.num_requests, disable=not use_tqdm, desc="hf+peft") as bar:
            for name, batch in batches:
                model.set_adapter(name)
                tokens += hf_generate_batch(model, batch, workload.output_len)
                bar.update(len(batch))
        return tokens

    return timed(HF_PEFT_RUN, workload, run)


def run_offline_bench(
    model: str,
    dtype: str,
    num_requests: int,
    prompt_len: int,
    output_len: int,
    baseline: str | None = None,
    hf_batch_size: int | None = None,
    seed: int = 0,
    engine_options: dict[str, object] | None = None,
    adapters: int = 0,
    lora_rank: int = 8,
    lora_targets: str | Sequence[str] = SUPPORTED_MODULES,
    use_tqdm: bool = True,
    ceiling: bool = False,
) -> BenchReport:
    """Builds the workload, runs our engine and optionally the HF baseline.

    `hf_batch_size` None means `default_hf_batch_size(adapters)`. With `adapters` > 0 the
    engine runs twice (base, then the requests spread over the adapters) and the baseline
    is HF + PEFT; see the module docstring. `engine_options` may override the LoRA
    options the bench picks (max_loras = max(adapters, 1), max_lora_rank = lora_rank).
    `dtype` may be 'auto' (the engine's choice; the HF baseline runs in the same one).
    `ceiling` (base model only) probes this machine's GEMM rates after the engine run
    and reports the throughput they allow for the workload (tools/engine_bench/ceiling.py) in the
    engine's dtype and every other one this CPU runs natively."""
    if baseline not in (None, "hf"):
        raise ValueError(f"unknown baseline {baseline!r}; the only one is 'hf'")
    if adapters < 0:
        raise ValueError(f"adapters must be >= 0, got {adapters}")
    if lora_rank < 1:
        raise ValueError(f"lora_rank must be >= 1, got {lora_rank}")
    if ceiling and adapters:
        raise ValueError("the ceiling is measured for the base model; run it without adapters")
    targets = parse_lora_targets(lora_targets)
    if hf_batch_size is None:
        hf_batch_size = default_hf_batch_size(adapters)
    dtype_option = parse_dtype_option(dtype)
    folder = resolve_model_folder(model)
    report = BenchReport(
        model=model,
        dtype=str(dtype_option),
        workload=Workload([], output_len),
        machine=MachineInfo.collect(),
        load_before=read_loadavg(),
    )
    if adapters:
        _run_lora_bench(
            report,
            folder,
            dtype_option,
            (num_requests, prompt_len, output_len),
            baseline,
            hf_batch_size,
            seed,
            dict(engine_options or {}),
            adapters,
            lora_rank,
            targets,
            use_tqdm,
        )
        report.load_after = read_loadavg()
        return report
    from loraplex.platform.llm import LLM

    llm = LLM(model=str(folder), dtype=dtype_option, seed=seed, **(engine_options or {}))
    torch_dtype = llm.engine.config.model.dtype
    quantization = engine_product(llm, folder)
    report.dtype = dtype_name(torch_dtype)
    pool = normal_token_ids(llm.tokenizer, model_vocab_size(folder))
    report.workload = build_workload(pool, num_requests, prompt_len, output_len, seed)
    scheduler = llm.engine.config.scheduler
    count = warmup_request_count(scheduler.max_num_batched_tokens, prompt_len, num_requests)
    warmup = build_workload(pool, count, prompt_len, output_len, seed + 1)
    report.results.append(run_engine(llm, report.workload, use_tqdm, warmup_prompts=warmup.prompts))
    arch, device = llm.engine.arch, llm.engine.device
    del llm
    gc.collect()
    if ceiling:
        fixed = FixedWorkload(num_requests, prompt_len, output_len)
        products = ceiling_products(device, torch_dtype, quantization)
        report.ceilings = [
            measure_ceiling(arch, d, fixed, scheduler, use_cache=False, quantization=q)
            for d, q in tqdm(products, disable=not use_tqdm, desc="GEMM probe")
        ]
    if baseline == "hf":
        report.results.append(run_hf(folder, report.workload, torch_dtype, hf_batch_size, use_tqdm))
    report.load_after = read_loadavg()
    return report


def engine_product(llm, folder: Path) -> QuantizedProduct | None:
    """How `llm`'s engine multiplies its projections where they are quantized: under
    `quantization`, or as an int4 checkpoint stores them (its group size)."""
    model_config = llm.engine.config.model
    mode = QUANTIZATIONS.get(model_config.quantization or "")
    if mode is not None:
        return QuantizedProduct(mode, model_config.quantize_lm_head)
    config = json.loads((folder / "config.json").read_text())
    if read_checkpoint_quantization(config) == INT4_MODE:
        scheme = read_int4_scheme(config)
        return QuantizedProduct(INT4, model_config.quantize_lm_head, scheme.group_size)
    return None


def ceiling_products(
    device: torch.device, dtype: torch.dtype, quantization: QuantizedProduct | None
) -> list[tuple[torch.dtype, QuantizedProduct | None]]:
    """The (dtype, int8 product) ceilings to probe: the engine's own first, then every
    other dtype this CPU multiplies natively, and int8 W8A8 with activations in the
    engine's dtype (where the native CPU ops that int8 needs are built)."""
    from loraplex.kernels import cpu_ops

    products = [(dtype, quantization)]
    products += [(d, None) for d in candidate_dtypes(device) if (d, None) not in products]
    if cpu_ops.load() and not any(q is not None and q.mode == "dynamic" for _, q in products):
        products.append((dtype, QuantizedProduct("dynamic")))
    return products


def _run_lora_bench(
    report: BenchReport,
    folder: Path,
    dtype: torch.dtype | str,
    shape: tuple[int, int, int],
    baseline: str | None,
    hf_batch_size: int,
    seed: int,
    engine_options: dict[str, object],
    num_adapters: int,
    rank: int,
    targets: tuple[str, ...],
    use_tqdm: bool,
) -> None:
    """The three runs of the bench with adapters, appended to `report.results`."""
    from loraplex.platform.llm import LLM

    names = [f"bench-lora-{i}" for i in range(num_adapters)]
    warmup_name = "bench-lora-warmup"
    engine_options.setdefault("max_loras", max(num_adapters, 1))
    engine_options.setdefault("max_lora_rank", rank)
    engine_options.setdefault(
        "max_cpu_loras", max(64, num_adapters + 1, int(engine_options["max_loras"]))
    )
    with tempfile.TemporaryDirectory(prefix="loraplex-bench-adapters-") as tmp:
        adapter_folders = make_bench_adapters(
            folder, Path(tmp), [*names, warmup_name], rank, targets, seed
        )
        gc.collect()
        llm = LLM(model=str(folder), dtype=dtype, seed=seed, **engine_options)
        dtype = llm.engine.config.model.dtype
        report.dtype = dtype_name(dtype)
        for name, adapter_folder in adapter_folders.items():
            llm.register_adapter(name, str(adapter_folder))
            llm.engine.load_adapter(name)  # disk -> host memory, before any timing
        pool = normal_token_ids(llm.tokenizer, model_vocab_size(folder))
        num_requests, prompt_len, output_len = shape
        report.workload = build_workload(pool, num_requests, prompt_len, output_len, seed)
        # Warm-up prompts outside the workload: neither run starts with prefix-cache hits,
        # and the warm-up adapter leaves every workload adapter's slot load to the timed run.
        budget = llm.engine.config.scheduler.max_num_batched_tokens
        count = warmup_request_count(budget, prompt_len, num_requests)
        warmup = build_workload(pool, count, prompt_len, output_len, seed + 1)
        report.lora = LoRABenchSetup(
            num_adapters=num_adapters,
            rank=rank,
            targets=targets,
            max_loras=int(engine_options["max_loras"]),
            hf_batch_size=hf_batch_size,
            warmup_requests=count,
        )
        request_adapters = spread_over(names, num_requests)
        report.results.append(
            run_engine(llm, report.workload, use_tqdm, name=BASE_RUN, warmup_prompts=warmup.prompts)
        )
        report.results.append(
            run_engine(
                llm,
                report.workload,
                use_tqdm,
                name=LORA_RUN,
                adapters=request_adapters,
                warmup_prompts=warmup.prompts,
                warmup_adapter=warmup_name,
            )
        )
        del llm
        gc.collect()
        if baseline == "hf":
            report.results.append(
                run_hf_peft(
                    folder,
                    report.workload,
                    dtype,
                    adapter_folders,
                    request_adapters,
                    hf_batch_size,
                    use_tqdm,
                )
            )


def format_report(report: BenchReport) -> str:
    """Human-readable summary: machine, workload, tokens/s per run, throughput ratios."""
    w, m = report.workload, report.machine
    lines = [
        f"machine: {m.processor}, {m.cpu_count} cpus ({m.usable_cores} usable), "
        f"torch {m.torch_version} with {m.torch_threads} threads",
        f"model: {report.model} ({report.dtype})",
        f"workload: {w.num_requests} requests x {len(w.prompts[0]) if w.prompts else 0} "
        f"prompt tokens -> {w.output_len} output tokens (greedy, ignore_eos)",
    ]
    lora = report.lora
    if lora is not None:
        lines += [
            f"adapters: {lora.num_adapters} PEFT LoRA, rank {lora.rank} on "
            f"{','.join(lora.targets)}; requests round-robin over them; "
            f"engine max_loras={lora.max_loras}",
            "  base = engine, every request on the base model; lora = same engine, "
            "requests on the adapters",
        ]
        if any(result.name == HF_PEFT_RUN for result in report.results):
            lines.append(
                "  hf+peft = HF generate + PeftModel (unmerged), requests grouped by adapter "
                f"in static batches of {lora.hf_batch_size}, set_adapter per group"
            )
        lines.append(
            f"  untimed engine warm-up: {lora.warmup_requests} requests outside the workload "
            "per run; adapters are read from disk into host memory before timing, "
            "engine slot loads are timed"
        )
    lines.append(f"loadavg before: {report.load_before}")
    for result in report.results:
        lines.append(
            f"{result.name:>9}: {result.output_tokens} tokens in {result.elapsed_s:.2f}s = "
            f"{result.tokens_per_s:.1f} generated tokens/s"
        )
    targets = {"lora/base": 0.8, "lora/hf+peft": 4.0}
    for label, ratio in report.ratios().items():
        target = f" (target >= {targets[label]:g}x)" if label in targets else ""
        lines.append(f"ratio {label}: {ratio:.2f}x{target}")
    if report.ceilings:
        first = report.ceilings[0]
        lines.append(
            f"ceiling: the workload's projections alone at this machine's GEMM rates "
            f"({first.num_threads} threads, {first.num_steps} steps; attention, norms and "
            "sampling count as free)"
        )
        for index, found in enumerate(report.ceilings):
            mark = " (engine dtype)" if index == 0 else ""
            lines.append(f"  {found.dtype:>9}: {found.tokens_per_s:.1f} tokens/s{mark}")
        lines.append(f"engine share of its ceiling: {report.ceiling_share():.2f} (target >= 0.85)")
    lines.append(f"loadavg after: {report.load_after}")
    return "\n".join(lines) + "\n"
