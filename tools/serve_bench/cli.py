"""`loraplex bench serve`: options, then one run: optionally start the app, send the
bursts, optionally run the offline baseline, print, write JSON and a PNG."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import math
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from loraplex.platform.thread_names import COMPUTE_THREAD_NAME
from loraplex.tools.serve_bench import report
from loraplex.tools.serve_bench.client import ClientOptions, RequestRecord, run_burst
from loraplex.tools.serve_bench.cpu_breakdown import (
    CpuBreakdown,
    ThreadTime,
    parse_pids,
    process_name,
    read_threads,
)
from loraplex.tools.serve_bench.offline import OfflineResult, OfflineSpec, run_in_subprocess
from loraplex.tools.serve_bench.serve_config import BenchServeConfig
from loraplex.tools.serve_bench.server import ServeApp
from loraplex.tools.serve_bench.server_counters import ServerCounters, settled_counters
from loraplex.tools.serve_bench.workload import (
    BenchRequest,
    WorkloadSpec,
    build_requests,
    model_names,
    parse_popularity,
)

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
WARMUP_PROMPTS = 16


def add_parser(bench_kinds: argparse._SubParsersAction) -> None:
    """Adds `serve` to `loraplex bench`."""
    p = bench_kinds.add_parser(
        "serve", help="HTTP load against an OpenAI-compatible server (ours or any other)"
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server root")
    p.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer key ($OPENAI_API_KEY)"
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help="base model name")
    p.add_argument(
        "--adapters",
        default="",
        help="comma-separated adapter names ('name' or 'base:name'): requests go round-robin",
    )
    p.add_argument(
        "--adapter-popularity",
        type=parse_popularity,
        default=None,
        metavar="uniform|zipf:S",
        help="how requests pick among --adapters: round-robin (uniform, the default) or "
        "Zipf with exponent S, the first adapter the most popular",
    )
    p.add_argument(
        "--compare-base",
        action="store_true",
        help="with --adapters: run each burst on the base model too (alternating) and print "
        "adapters/base",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="model folder or registered name whose ordinary token ids make random prompts "
        "(default: the served model's, from --serve-config, else --model)",
    )
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128, help="random prompt tokens")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--prefix-len", type=int, default=0, help="shared prefix tokens before each prompt"
    )
    p.add_argument(
        "--prefix-groups",
        type=int,
        default=1,
        help="with --prefix-len: this many distinct prefixes, one drawn per request",
    )
    p.add_argument(
        "--server-counters",
        action="store_true",
        help="read loraplex's /metrics before and after each burst and report its adapter "
        "loads and prefix-cache hit rate",
    )
    p.add_argument(
        "--metrics-key", default=None, help="operator key for /metrics (default: --api-key)"
    )
    p.add_argument(
        "--dataset", type=Path, default=None, help="JSONL: {'prompt': ..., 'output_len': ...}"
    )
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals per second (default: all at once)",
    )
    p.add_argument(
        "--bursts", type=int, default=1, help="run the workload this many times (new prompts each)"
    )
    p.add_argument("--no-stream", dest="stream", action="store_false")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request deadline, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--serve-config",
        type=Path,
        default=None,
        help="start `serve run FILE` first, stop it after",
    )
    p.add_argument(
        "--synthetic-adapters",
        type=int,
        default=0,
        help="with --serve-config: add N random rank-8 PEFT adapters (bench-lora-0..) to the "
        "model and, unless --adapters is given, spread the requests over them",
    )
    p.add_argument(
        "--offline-baseline",
        action="store_true",
        help="run the first burst's requests through the engine offline (same engine options "
        "as --serve-config's model, separate process) and print served/offline",
    )
    p.add_argument(
        "--cpu-breakdown",
        default=None,
        metavar="PIDS",
        help="after each burst, CPU-us per output token spent outside the engine's compute "
        "threads, per process, read from /proc: comma-separated PIDs of the server's "
        "processes, or 'auto' for this machine's Ray processes (Linux)",
    )
    p.add_argument(
        "--compute-threads",
        default=COMPUTE_THREAD_NAME,
        help="OS thread-name prefix of the server's compute threads (loraplex names its "
        "engine's step thread and its OpenMP workers so)",
    )
    p.add_argument(
        "--output-dir", type=Path, default=None, help="write bench_serve.json and .png here"
    )
    p.set_defaults(handler=run_bench_serve)


def _token_pool(tokenizer_spec: str) -> list[int]:
    from loraplex.platform.model_files import resolve_model_folder
    from loraplex.platform.tokenizer import load_tokenizer
    from loraplex.tools.engine_bench.offline import model_vocab_size, normal_token_ids

    folder = resolve_model_folder(tokenizer_spec)
    return normal_token_ids(load_tokenizer(folder), model_vocab_size(folder))


def _bursts(
    args: argparse.Namespace, models: tuple[str, ...], pool: list[int]
) -> list[tuple[str, list[BenchRequest]]]:
    """(label, requests) per burst; with --compare-base each burst runs base then adapters."""
    runs = []
    for index in range(args.bursts):
        spec = WorkloadSpec(
            num_prompts=args.num_prompts,
            prompt_len=args.prompt_len,
            output_len=args.output_len,
            models=models,
            prefix_len=args.prefix_len,
            request_rate=args.request_rate,
            seed=args.seed + index,
            dataset=args.dataset,
            zipf_s=args.adapter_popularity,
            prefix_groups=args.prefix_groups,
        )
        requests = build_requests(spec, pool)
        if args.compare_base and models != (args.model,):
            base = [dataclasses.replace(r, model=args.model) for r in requests]
            runs.append((f"base-{index + 1}", base))
            runs.append((f"adapters-{index + 1}", requests))
        else:
            runs.append((f"burst-{index + 1}", requests))
    return runs


def _warmup_prompts(args: argparse.Namespace, pool: list[int]) -> list[list[int]]:
    """Prompts outside every burst (their own seed) for the offline baseline's warm-up."""
    spec = WorkloadSpec(WARMUP_PROMPTS, args.prompt_len, 4, (args.model,), seed=args.seed + 9999)
    return [r.prompt for r in build_requests(spec, pool)]


def _ratios(summaries: Sequence[report.BurstSummary], offline: OfflineResult | None) -> list[str]:
    lines = []
    if offline is not None:
        lines.append(
            f"offline: {offline.output_tok_s:.1f} tok/s, all prefilled after "
            f"{offline.prefill_done_s * 1000:.0f} ms, batch-1 decode step "
            f"{offline.batch1_decode_step_s * 1000:.1f} ms ({offline.threads} threads)"
        )
        for s in summaries:
            lines.append(
                f"[{s.name}] served/offline tok/s {s.output_tok_s / offline.output_tok_s:.3f}x; "
                f"ttft p50 / offline prefill {s.ttft.p50_ms / (offline.prefill_done_s * 1000):.2f}x; "
                f"itl p50 / offline batch-1 step "
                f"{s.itl.p50_ms / (offline.batch1_decode_step_s * 1000):.2f}x"
            )
    bases = [s for s in summaries if s.name.startswith("base-")]
    loras = [s for s in summaries if s.name.startswith("adapters-")]
    for base, lora in zip(bases, loras, strict=False):
        lines.append(
            f"[{lora.name}] adapters/base tok/s {lora.output_tok_s / base.output_tok_s:.3f}x"
        )
    return lines


def _counters(args: argparse.Namespace) -> ServerCounters | None:
    """The server's counters once settled (so the last burst's are in), with
    --server-counters."""
    if not args.server_counters:
        return None
    return settled_counters(args.url, args.metrics_key or args.api_key)


@dataclass(frozen=True)
class _CpuWatch:
    """The server processes' threads at a burst's start (--cpu-breakdown)."""

    pids: tuple[int, ...]
    names: dict[int, str]
    before: dict[tuple[int, int], ThreadTime]
    compute_prefix: str

    @classmethod
    def start(cls, args: argparse.Namespace) -> _CpuWatch | None:
        if args.cpu_breakdown is None:
            return None
        pids = tuple(parse_pids(args.cpu_breakdown))
        names = {pid: process_name(pid) for pid in pids}
        return cls(pids, names, read_threads(pids), args.compute_threads)

    def lines(self, output_tokens: int) -> list[str]:
        after = read_threads(self.pids)
        breakdown = CpuBreakdown.between(self.before, after, self.names, self.compute_prefix)
        return breakdown.lines(output_tokens)


def run_bench_serve(args: argparse.Namespace) -> int:
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="loraplex-bench-serve-") as tmp:
        config = None
        if args.serve_config is not None:
            config = BenchServeConfig.load(args.serve_config, args.model)
            if args.synthetic_adapters:
                config = config.with_synthetic_adapters(args.synthetic_adapters, Path(tmp))
        elif args.synthetic_adapters or args.offline_baseline:
            sys.stderr.write(
                "error: --synthetic-adapters and --offline-baseline need --serve-config\n"
            )
            return 2
        adapters = [a for a in args.adapters.split(",") if a]
        if not adapters and config is not None and args.synthetic_adapters:
            adapters = list(config.synthetic_names)
        models = model_names(args.model, adapters)
        tokenizer = args.tokenizer or (config.model_spec if config else args.model)
        pool = _token_pool(tokenizer)
        bursts = _bursts(args, models, pool)
        meta = report.BenchMeta(
            url=args.url,
            workload={
                "num_prompts": args.num_prompts,
                "prompt_len": args.prompt_len if args.dataset is None else "dataset",
                "prefix_len": args.prefix_len,
                "output_len": args.output_len,
                "max_concurrency": args.max_concurrency,
                "request_rate": args.request_rate,
                "models": ",".join(models),
                "adapter_popularity": (
                    "uniform"
                    if args.adapter_popularity is None
                    else f"zipf:{args.adapter_popularity}"
                ),
                "prefix_groups": args.prefix_groups,
                "stream": args.stream,
            },
        )
        if config is not None:
            log_path = (args.output_dir or Path(tmp)) / "serve-run.log"
            if args.output_dir:
                args.output_dir.mkdir(parents=True, exist_ok=True)
            stack.enter_context(
                ServeApp(config.path, args.url, log_path, args.api_key, cwd=config.cwd)
            )
        options = ClientOptions(
            base_url=args.url,
            api_key=args.api_key,
            max_concurrency=args.max_concurrency,
            stream=args.stream,
            ignore_eos=args.ignore_eos,
            timeout_s=args.timeout,
        )
        summaries, records = [], []
        for label, requests in bursts:
            before = _counters(args)
            cpu = _CpuWatch.start(args)
            burst: list[RequestRecord] = asyncio.run(run_burst(requests, options, label))
            summary = report.summarize(label, burst)
            cpu_lines = cpu.lines(summary.output_tokens) if cpu is not None else []
            after = _counters(args)
            if before is not None and after is not None:
                summary = dataclasses.replace(summary, server=after.minus(before))
            summaries.append(summary)
            records.append(burst)
            sys.stdout.write("\n".join([*summaries[-1].lines(), *cpu_lines]) + "\n")
            sys.stdout.flush()
        stack.close()
        offline = None
        if args.offline_baseline:
            first = bursts[0][1]
            offline = run_in_subprocess(
                OfflineSpec(
                    model=config.model_spec,
                    engine=config.engine,
                    prompts=[r.prompt for r in first],
                    adapters=[config.adapter_folder(r.model) for r in first],
                    output_len=args.output_len,
                    warmup_prompts=_warmup_prompts(args, pool),
                ),
                Path(tmp),
            )
            meta.offline = dataclasses.asdict(offline)
        meta.load_after = report.read_loadavg()
        lines = meta.lines() + _ratios(summaries, offline)
        sys.stdout.write("\n".join(lines) + "\n")
        if args.output_dir is not None:
            args.output_dir.mkdir(parents=True, exist_ok=True)
            report.write_json(args.output_dir / "bench_serve.json", meta, summaries, records)
            report.plot(
                args.output_dir / "bench_serve.png",
                summaries,
                records,
                f"loraplex bench serve: {meta.cpu}, {time.strftime('%Y-%m-%d %H:%M')}",
            )
            sys.stdout.write(f"wrote {args.output_dir}/bench_serve.json and .png\n")
    failed = sum(s.num_requests - s.completed for s in summaries)
    return 1 if failed else 0
