"""The `loraplex` command: `generate` streams one completion; `bench offline` and `bench
serve` measure throughput (tools/engine_bench, tools/serve_bench); `check` probes a
running app (tools/check); `probe dtype` records what `dtype: auto` runs in on this
machine (platform/dtype_choice.py). Parsing and dispatch only; the work lives in those
modules and the engine."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from loraplex.tools.check.cli import add_parser as add_check
from loraplex.tools.serve_bench.cli import add_parser as add_serve_bench

DEFAULT_MODEL = "smollm2-135m-instruct"


def _add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"registered model name or local HF folder (default: {DEFAULT_MODEL})",
    )


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    _add_model_argument(parser)
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="weights dtype (auto: bf16 on a GPU; on a CPU what `loraplex probe dtype` "
        "recorded, else bf16 with AMX and fp32 without)",
    )
    parser.add_argument("--seed", type=int, default=0, help="engine / workload seed")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loraplex", description="Multi-tenant, multi-LoRA LLM serving."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    command_parsers = parser.add_subparsers(dest="command", required=True)

    generate = command_parsers.add_parser("generate", help="stream a completion for one prompt")
    generate.add_argument("prompt", help="the prompt (or the user message with --chat)")
    _add_model_options(generate)
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    generate.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="wrap the prompt in the chat template (default: when the tokenizer has one)",
    )
    generate.set_defaults(handler=run_generate)

    bench = command_parsers.add_parser("bench", help="benchmarks")
    bench_kinds = bench.add_subparsers(dest="bench_kind", required=True)
    offline = bench_kinds.add_parser("offline", help="offline throughput on a fixed workload")
    _add_model_options(offline)
    offline.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="requests per run (default: 64; --speculative: 8 per workload; --guided: 32)",
    )
    offline.add_argument("--prompt-len", type=int, default=128)
    offline.add_argument("--output-len", type=int, default=64)
    offline.add_argument("--baseline", choices=("hf",), default=None, help="also run HF generate")
    offline.add_argument(
        "--hf-batch-size",
        type=int,
        default=None,
        help="HF static batch size (default: 16, or 8 per adapter group with --adapters)",
    )
    offline.add_argument("--max-num-seqs", type=int, default=None, help="engine batch limit")
    offline.add_argument(
        "--quantization",
        choices=["int8", "int8_weight_only"],
        default=None,
        help="the projections in int8 (CPU; platform/config.py ModelConfig)",
    )
    offline.add_argument(
        "--quantize-lm-head",
        action="store_true",
        help="with --quantization: the LM head in int8 too",
    )
    offline.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="engine per-step token budget"
    )
    offline.add_argument(
        "--adapters",
        type=int,
        default=0,
        help="N > 0: also time the workload spread over N random PEFT LoRA adapters "
        "(and HF + PEFT as the baseline); 0: base model only",
    )
    offline.add_argument("--lora-rank", type=int, default=8, help="rank of the bench adapters")
    offline.add_argument(
        "--lora-targets",
        default="q,k,v,o,gate,up,down",
        help="projections the bench adapters adapt, comma separated",
    )
    offline.add_argument(
        "--max-loras", type=int, default=None, help="engine adapter slots (default: max(N, 1))"
    )
    offline.add_argument(
        "--ceiling",
        action="store_true",
        help="also probe this machine's GEMM rates and print the throughput they allow "
        "for the workload (per dtype) and the engine's share of it",
    )
    offline.add_argument(
        "--speculative",
        choices=("ngram",),
        default=None,
        help="instead: time single-stream decoding with and without this speculative "
        "method, alternating, on a copy-heavy and a random workload",
    )
    offline.add_argument("--num-speculative-tokens", type=int, default=4)
    offline.add_argument("--prompt-lookup-max", type=int, default=4)
    offline.add_argument("--prompt-lookup-min", type=int, default=2)
    offline.add_argument(
        "--guided",
        action="store_true",
        help="instead: time one batch unguided, guided by a JSON schema and by a regex, "
        "alternating, and print each guided run's cost per output token",
    )
    offline.add_argument(
        "--quality",
        action="store_true",
        help="instead: perplexity of a shipped text and greedy agreement of the engine "
        "with these options against the same dtype without them",
    )
    offline.add_argument(
        "--host-overhead",
        action="store_true",
        help="instead: per-step host time outside the kernels (CPU), at batch 1 and at "
        "--num-requests (default 64), in us per step and per layer",
    )
    offline.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="--speculative / --guided / --host-overhead: alternating rounds (default 2 / 3 / 3)",
    )
    offline.set_defaults(handler=run_bench_offline)
    add_serve_bench(bench_kinds)
    add_check(command_parsers)
    _add_probe_command(command_parsers)
    _add_quantize_command(command_parsers)
    return parser


def _add_quantize_command(command_parsers: argparse._SubParsersAction) -> None:
    quantize = command_parsers.add_parser(
        "quantize",
        help="write a compressed-tensors checkpoint (int8 W8A8 or W8A16 per channel, int4 "
        "W4A16 per group) of a float model folder",
    )
    _add_model_argument(quantize)
    quantize.add_argument("--out", required=True, help="the folder to write")
    quantize.add_argument("--scheme", choices=["W8A8", "W8A16", "W4A16"], default="W8A8")
    quantize.add_argument(
        "--group-size",
        type=int,
        default=128,
        help="W4A16: inputs per group (0: one group per output channel)",
    )
    quantize.add_argument("--asymmetric", action="store_true", help="W4A16: zero points per group")
    quantize.set_defaults(handler=run_quantize)


def run_quantize(args: argparse.Namespace) -> int:
    from loraplex.platform.model_files import resolve_model_folder
    from loraplex.tools.quantize import quantize_folder

    out = quantize_folder(
        resolve_model_folder(args.model),
        Path(args.out),
        args.scheme,
        group_size=args.group_size or None,
        symmetric=not args.asymmetric,
    )
    sys.stdout.write(f"wrote {out} ({args.scheme})\n")
    return 0


def _add_probe_command(command_parsers: argparse._SubParsersAction) -> None:
    probe = command_parsers.add_parser("probe", help="measure this machine for the engine")
    kinds = probe.add_subparsers(dest="probe_kind", required=True)
    dtype = kinds.add_parser(
        "dtype",
        help="time each CPU dtype's projections on 64 x 128 -> 64 and record the fastest "
        "as what `dtype: auto` runs in for this model shape and thread count",
    )
    _add_model_argument(dtype)
    dtype.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads, as many as the engine computes with (default: torch's)",
    )
    dtype.add_argument(
        "--if-missing",
        action="store_true",
        help="measure only where no record exists yet for this CPU, torch, model shape "
        "and thread count (what scripts/install.sh runs)",
    )
    dtype.set_defaults(handler=run_probe_dtype)


def run_probe_dtype(args: argparse.Namespace) -> int:
    import torch

    from loraplex.platform.arch import ModelArch
    from loraplex.platform.config import SchedulerConfig
    from loraplex.platform.dtype_choice import read_record, record_path
    from loraplex.platform.model_files import resolve_model_folder
    from loraplex.tools.engine_bench.ceiling import REFERENCE_WORKLOAD, record_dtype

    arch = ModelArch.from_folder(resolve_model_folder(args.model))
    scheduler = SchedulerConfig(max_num_seqs=REFERENCE_WORKLOAD.num_requests)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or threads)
    try:
        path = record_path(arch, torch.get_num_threads())
        record = read_record(path) if args.if_missing else None
        if record is not None:
            sys.stdout.write(
                f"dtype auto -> {str(record[0]).removeprefix('torch.')} for {args.model} on "
                f"{torch.get_num_threads()} threads (already recorded in {path})\n"
            )
            return 0
        dtype, path = record_dtype(arch, scheduler)
        sys.stdout.write(
            f"dtype auto -> {str(dtype).removeprefix('torch.')} for {args.model} on "
            f"{torch.get_num_threads()} threads (recorded in {path})\n"
        )
    finally:
        torch.set_num_threads(threads)
    return 0


def stream_text(engine, request_id: str, prompt: str | list[int], params) -> Iterator[str]:
    """Adds one request and yields each new piece of its text as the engine steps."""
    engine.add_request(request_id, prompt, params)
    emitted = ""
    while engine.has_unfinished():
        for output in engine.step():
            if output.request_id != request_id:
                continue
            text = output.text
            if len(text) > len(emitted) and text.startswith(emitted):
                yield text[len(emitted) :]
                emitted = text


def run_generate(args: argparse.Namespace) -> int:
    from loraplex.platform.llm import LLM
    from loraplex.platform.request import SamplingParams
    from loraplex.platform.tokenizer import apply_chat_template, has_chat_template

    llm = LLM(model=args.model, dtype=args.dtype, seed=args.seed)
    has_template = has_chat_template(llm.tokenizer)
    use_chat = has_template if args.chat is None else args.chat
    if use_chat and not has_template:
        sys.stderr.write("error: this model's tokenizer has no chat template; use --no-chat\n")
        return 2
    prompt = args.prompt
    if use_chat:
        prompt = apply_chat_template(llm.tokenizer, [{"role": "user", "content": args.prompt}])
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
    for piece in stream_text(llm.engine, "cli-generate", prompt, params):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def run_bench_offline(args: argparse.Namespace) -> int:
    from loraplex.tools.engine_bench import offline

    engine_options = {
        name: value
        for name, value in (
            ("max_num_seqs", args.max_num_seqs),
            ("max_num_batched_tokens", args.max_num_batched_tokens),
            ("max_loras", args.max_loras),
            ("quantization", args.quantization),
            ("quantize_lm_head", args.quantize_lm_head or None),
        )
        if value is not None
    }
    if args.speculative is not None:
        return run_spec_bench(args, engine_options)
    if args.guided:
        return run_guided_bench(args, engine_options)
    if args.host_overhead:
        return run_host_overhead_bench(args, engine_options)
    if args.quality:
        return run_quality_bench(args, engine_options)
    report = offline.run_offline_bench(
        model=args.model,
        dtype=args.dtype,
        num_requests=args.num_requests or 64,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        baseline=args.baseline,
        hf_batch_size=args.hf_batch_size,
        seed=args.seed,
        engine_options=engine_options,
        adapters=args.adapters,
        lora_rank=args.lora_rank,
        lora_targets=args.lora_targets,
        ceiling=args.ceiling,
    )
    sys.stdout.write(offline.format_report(report))
    return 0


def run_quality_bench(args: argparse.Namespace, engine_options: dict[str, object]) -> int:
    from loraplex.tools.engine_bench import quality

    reference = "bfloat16" if args.dtype == "auto" else args.dtype
    variants = {reference: {"dtype": reference}}
    if engine_options:
        name = " ".join(f"{k}={v}" for k, v in engine_options.items())
        variants[f"{reference} {name}"] = {"dtype": reference, **engine_options}
    results = quality.run_quality(args.model, variants)
    sys.stdout.write(quality.format_quality(args.model, results))
    return 0


def run_host_overhead_bench(args: argparse.Namespace, engine_options: dict[str, object]) -> int:
    from loraplex.tools.engine_bench import host_overhead

    report = host_overhead.run_host_bench(
        model=args.model,
        dtype=args.dtype,
        batches=(1, args.num_requests or 64),
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        rounds=args.rounds or 3,
        seed=args.seed,
        engine_options=engine_options,
    )
    sys.stdout.write(host_overhead.format_host_report(report))
    return 0


def run_spec_bench(args: argparse.Namespace, engine_options: dict[str, object]) -> int:
    from loraplex.tools.engine_bench import speculative

    config = {
        "method": args.speculative,
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_max": args.prompt_lookup_max,
        "prompt_lookup_min": args.prompt_lookup_min,
    }
    report = speculative.run_spec_bench(
        model=args.model,
        dtype=args.dtype,
        speculative_config=config,
        num_requests=args.num_requests or 8,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        rounds=args.rounds or 2,
        seed=args.seed,
        engine_options=engine_options,
    )
    sys.stdout.write(speculative.format_spec_report(report))
    return 0


def run_guided_bench(args: argparse.Namespace, engine_options: dict[str, object]) -> int:
    from loraplex.tools.engine_bench import guided

    report = guided.run_guided_bench(
        model=args.model,
        dtype=args.dtype,
        num_requests=args.num_requests or 32,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        rounds=args.rounds or 3,
        seed=args.seed,
        engine_options=engine_options,
    )
    sys.stdout.write(guided.format_guided_report(report))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
