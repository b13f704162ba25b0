"""Kernel microbenchmarks: `python -m loraplex.kernels.bench [--only NAME ...] [--list]`.

A small registry of named benchmarks; each one adds its own command-line options and
returns `Measurement`s (time, bytes moved, FLOPs), which are printed as one table with
achieved GB/s, TFLOP/s and, on a GPU listed in `DEVICE_PEAKS`, the fraction of its peak
HBM bandwidth and dense bf16 tensor throughput. Register a new benchmark with
`@register("name", add_arguments)`.

Timing needs CUDA (`triton.testing.do_bench`, median of repeated runs). Without a GPU the
command says so and exits 0: on a CPU the Triton kernels only run under the interpreter,
whose timings measure Python, not the kernels.

Bytes counted per kernel (es = element size of the model dtype, y is fp32):
    shrink  x [T, in] read, A of each distinct slot used [R, in] read, y [T, R] written
    expand  y [T, R] read, B of each distinct slot used [out, R] read, out [T, out] read
            and written
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class DevicePeak:
    name: str
    bytes_per_s: float
    """Peak HBM bandwidth."""
    flops_per_s: float
    """Peak dense bf16 tensor-core throughput."""


DEVICE_PEAKS: tuple[tuple[tuple[str, ...], DevicePeak], ...] = (
    # (substrings that must all occur in torch.cuda.get_device_name(), peak)
    (("H200",), DevicePeak("H200", 4.8e12, 989e12)),
    (("H100", "HBM3"), DevicePeak("H100 SXM", 3.35e12, 989e12)),
    (("H100", "SXM"), DevicePeak("H100 SXM", 3.35e12, 989e12)),
)


def device_peak(device_name: str) -> DevicePeak | None:
    """Peak numbers for a CUDA device name; None for an unknown device."""
    for needles, peak in DEVICE_PEAKS:
        if all(needle in device_name for needle in needles):
            return peak
    return None


@dataclass(frozen=True)
class Measurement:
    name: str
    shape: str
    ms: float
    bytes: int
    flops: int


@dataclass(frozen=True)
class Benchmark:
    name: str
    run: Callable[[argparse.Namespace], list[Measurement]]
    add_arguments: Callable[[argparse.ArgumentParser], None] | None


BENCHMARKS: dict[str, Benchmark] = {}


def register(
    name: str, add_arguments: Callable[[argparse.ArgumentParser], None] | None = None
) -> Callable[[Callable[[argparse.Namespace], list[Measurement]]], Callable]:
    """Decorator: adds `run(args) -> list[Measurement]` to the registry under `name`."""

    def decorate(run: Callable[[argparse.Namespace], list[Measurement]]) -> Callable:
        if name in BENCHMARKS:
            raise ValueError(f"benchmark {name!r} registered twice")
        BENCHMARKS[name] = Benchmark(name, run, add_arguments)
        return run

    return decorate


def time_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds of fn() on the current CUDA device."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


# ----------------------------------------------------------------------------- LoRA


def _lora_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("lora")
    group.add_argument("--lora-in", type=int, default=4096, help="input features")
    group.add_argument("--lora-out", type=int, default=4096, help="output features")
    group.add_argument("--lora-rank", type=int, default=16, help="R, stacked rank columns")
    group.add_argument("--lora-slots", type=int, default=8, help="L, adapter slots")
    group.add_argument("--decode-tokens", type=int, default=64, help="BGMV batch")
    group.add_argument("--segments", type=int, default=8, help="SGMV prefill segments")
    group.add_argument("--segment-len", type=int, default=256, help="tokens per segment")


@register("lora", _lora_arguments)
def bench_lora(args: argparse.Namespace) -> list[Measurement]:
    """BGMV on a decode batch (tokens spread evenly over the slots, sorted), SGMV on
    prefill segments (segment g uses slot g % L), then add_lora on both together through
    the Triton and the torch paths."""
    from loraplex.kernels import triton_lora
    from loraplex.kernels.lora import LoRABatch, torch_add_lora, triton_add_lora

    device = torch.device("cuda")
    dtype = DTYPES[args.dtype]
    es = torch.empty((), dtype=dtype).element_size()
    k_dim, n_dim, rank, num_slots = args.lora_in, args.lora_out, args.lora_rank, args.lora_slots
    decodes = args.decode_tokens
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    lora_a = randn(num_slots, rank, k_dim, scale=k_dim**-0.5)
    lora_b = randn(num_slots, n_dim, rank, scale=rank**-0.5)
    decode_slots = [t * num_slots // max(decodes, 1) for t in range(decodes)]
    prefill_slots = [g % num_slots for g in range(args.segments) for _ in range(args.segment_len)]
    mixed = LoRABatch.from_token_slots(decode_slots + prefill_slots, decodes, device)
    prefill = LoRABatch.from_token_slots(prefill_slots, 0, device)
    decode = LoRABatch.from_token_slots(decode_slots, decodes, device)
    num_tokens = len(prefill_slots)

    def traffic(tokens: int, distinct: int) -> tuple[int, int]:
        """(shrink bytes, expand bytes) for `tokens` tokens over `distinct` slots."""
        shrink = tokens * k_dim * es + distinct * rank * k_dim * es + tokens * rank * 4
        expand = tokens * rank * 4 + distinct * n_dim * rank * es + 2 * tokens * n_dim * es
        return shrink, expand

    shape = f"in={k_dim} R={rank} out={n_dim} L={num_slots} {args.dtype}"
    results = []

    x = randn(decodes, k_dim)
    y = torch.zeros(decodes, rank, dtype=torch.float32, device=device)
    out = randn(decodes, n_dim)
    shrink_bytes, expand_bytes = traffic(decodes, len(set(decode_slots)))
    slots = decode.token_slots
    results.append(
        Measurement(
            "bgmv_shrink",
            f"D={decodes} {shape}",
            time_ms(lambda: triton_lora.bgmv_shrink(x, lora_a, slots, y)),
            shrink_bytes,
            2 * decodes * k_dim * rank,
        )
    )
    results.append(
        Measurement(
            "bgmv_expand",
            f"D={decodes} {shape}",
            time_ms(lambda: triton_lora.bgmv_expand(y, lora_b, slots, out)),
            expand_bytes,
            2 * decodes * rank * n_dim,
        )
    )

    x = randn(num_tokens, k_dim)
    y = torch.zeros(num_tokens, rank, dtype=torch.float32, device=device)
    out = randn(num_tokens, n_dim)
    segs = (prefill.seg_starts, prefill.seg_lens, prefill.seg_slots, prefill.max_seg_len)
    shrink_bytes, expand_bytes = traffic(num_tokens, len(set(prefill_slots)))
    seg_shape = f"S={args.segments}x{args.segment_len} {shape}"
    results.append(
        Measurement(
            "sgmv_shrink",
            seg_shape,
            time_ms(lambda: triton_lora.sgmv_shrink(x, lora_a, *segs, y)),
            shrink_bytes,
            2 * num_tokens * k_dim * rank,
        )
    )
    results.append(
        Measurement(
            "sgmv_expand",
            seg_shape,
            time_ms(lambda: triton_lora.sgmv_expand(y, lora_b, *segs, out)),
            expand_bytes,
            2 * num_tokens * rank * n_dim,
        )
    )

    total = decodes + num_tokens
    x = randn(total, k_dim)
    out = randn(total, n_dim)
    shrink_bytes, expand_bytes = traffic(total, len(set(decode_slots + prefill_slots)))
    mixed_shape = f"D={decodes} + {seg_shape}"
    flops = 2 * total * rank * (k_dim + n_dim)
    for name, path in (("add_lora triton", triton_add_lora), ("add_lora torch", torch_add_lora)):
        results.append(
            Measurement(
                name,
                mixed_shape,
                time_ms(lambda path=path: path(out, x, lora_a, lora_b, mixed)),
                shrink_bytes + expand_bytes,
                flops,
            )
        )
    return results


# ----------------------------------------------------------------------------- CLI


def format_table(results: Sequence[Measurement], peak: DevicePeak | None) -> str:
    header = ["kernel", "shape", "time us", "GB/s", "TFLOP/s"]
    if peak is not None:
        header += [f"%BW ({peak.name})", "%FLOP"]
    rows = [header]
    for m in results:
        seconds = m.ms * 1e-3
        row = [
            m.name,
            m.shape,
            f"{m.ms * 1e3:.1f}",
            f"{m.bytes / seconds / 1e9:.0f}",
            f"{m.flops / seconds / 1e12:.2f}",
        ]
        if peak is not None:
            row += [
                f"{100 * m.bytes / seconds / peak.bytes_per_s:.1f}",
                f"{100 * m.flops / seconds / peak.flops_per_s:.2f}",
            ]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loraplex.kernels.bench", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=sorted(BENCHMARKS),
        help="run only this benchmark (repeatable; default: all)",
    )
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    for benchmark in BENCHMARKS.values():
        if benchmark.add_arguments is not None:
            benchmark.add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.list:
        sys.stdout.write("\n".join(sorted(BENCHMARKS)) + "\n")
        return 0
    if not torch.cuda.is_available():
        sys.stdout.write(
            "kernel benchmarks need CUDA for timing (on a CPU the Triton kernels only run "
            "under the interpreter); nothing to do\n"
        )
        return 0
    device_name = torch.cuda.get_device_name()
    peak = device_peak(device_name)
    sys.stdout.write(f"device: {device_name} (peak: {peak or 'unknown'})\n")
    results: list[Measurement] = []
    for name in args.only or sorted(BENCHMARKS):
        results.extend(BENCHMARKS[name].run(args))
    sys.stdout.write(format_table(results, peak) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
