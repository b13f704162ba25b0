"""Kernel microbenchmarks: `python -m loraplex.tools.engine_bench.kernels [--only NAME ...] [--list]`.

A small registry of named benchmarks; each one adds its own command-line options and
returns `Measurement`s (time, bytes moved, FLOPs), which are printed as one table with
achieved GB/s, TFLOP/s and, on a GPU listed in `DEVICE_PEAKS`, the fraction of its peak
HBM bandwidth and dense bf16 tensor throughput. Register a new benchmark with
`@register("name", add_arguments)`.

Timing needs CUDA (`triton.testing.do_bench`, median of repeated runs). Without a GPU the
command says so and exits 0: on a CPU the Triton kernels only run under the interpreter,
whose timings measure Python, not the kernels.

Bytes counted per kernel: the least traffic the operation needs (es = element size of
the model dtype, y is fp32):
    shrink   x [T, in] read, A of each distinct slot used [R, in] read, y [T, R] written
    expand   y [T, R] read, B of each distinct slot used [out, R] read, out [T, out] read
             and written
    decode   every sequence's K and V [L, Hkv, Dh] read once, q and out [D, H, Dh]
    prefill  every chunk's K and V [L, Hkv, Dh] read once, q and out [Tp, H, Dh]
    rms_norm x and residual read, normed rows and new residual written [T, hidden]
    rotary   q, k, v read, q and k written back, k and v written to the cache, cos / sin
FLOPs: 4 * H * Dh per (query, visible key) pair for attention (q.K and P.V).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

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


def bench_device() -> torch.device:
    """Where benchmarks allocate: the current CUDA device (tests point it at the CPU to
    run each benchmark's code once under the Triton interpreter)."""
    return torch.device("cuda")


TIMINGS = ("events", "kernels")
_timing = "events"
"""How `time_ms` times (main sets it from --timing): 'events' = wall time between CUDA
events around each call (triton's do_bench), launch gaps included; 'kernels' = the
device's own time, the sum of the call's kernel durations as the profiler (CUPTI)
records them. Both flush the L2 cache before every call."""


def time_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds of fn() on the current CUDA device (see `_timing`)."""
    if _timing == "kernels":
        return kernel_time_ms(fn)
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


@triton.jit
def _flush_l2_kernel(ptr, n, BLOCK: tl.constexpr):
    """Writes zeros over a buffer larger than the L2 cache; its name marks, in a profile,
    where each timed call starts."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(ptr + offs, tl.zeros([BLOCK], dtype=tl.int32), mask=offs < n)


def kernel_time_ms(fn: Callable[[], object], reps: int = 50) -> float:
    """Median over `reps` calls of the summed durations of the device work (kernels,
    copies, fills) that one call of fn launches, the L2 cache flushed before each call.
    Host launch overhead and gaps between launches are not counted."""
    flush_words = 64 << 20  # 256 MB of int32, several times any L2
    flush = torch.empty(flush_words, dtype=torch.int32, device=bench_device())
    block = 1024
    grid = (triton.cdiv(flush_words, block),)
    for _ in range(3):  # compile and warm up outside the profile
        _flush_l2_kernel[grid](flush, flush_words, BLOCK=block)
        fn()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        for _ in range(reps):
            _flush_l2_kernel[grid](flush, flush_words, BLOCK=block)
            fn()
        torch.cuda.synchronize()
    device_events = sorted(
        (e for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    per_call: list[float] = []
    for event in device_events:
        if event.name == "_flush_l2_kernel":
            per_call.append(0.0)
        elif per_call:
            per_call[-1] += event.time_range.elapsed_us()
    if len(per_call) != reps:
        raise RuntimeError(f"profiled {len(per_call)} of {reps} calls; cannot time kernels")
    return statistics.median(per_call) * 1e-3


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

    device = bench_device()
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


# ----------------------------------------------------------------------------- attention


def _attention_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("attention")
    group.add_argument("--heads", type=int, default=32, help="H, query heads")
    group.add_argument("--kv-heads", type=int, default=8, help="Hkv, kv heads")
    group.add_argument("--head-dim", type=int, default=128)
    group.add_argument("--block-size", type=int, default=16, help="KV cache block size")
    group.add_argument("--batch", type=int, default=64, help="decode sequences")
    group.add_argument("--context", type=int, default=1024, help="tokens per decode sequence")
    group.add_argument("--chunks", type=int, default=4, help="prefill chunks")
    group.add_argument("--chunk-len", type=int, default=512, help="new tokens per chunk")
    group.add_argument("--prefix-len", type=int, default=512, help="cached tokens per chunk")


def _paged_layout(
    seq_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random cache holding the sequences in shuffled blocks, and their block tables."""
    device = bench_device()
    counts = [-(-length // block_size) for length in seq_lens]
    num_blocks = sum(counts)
    order = torch.randperm(num_blocks, device=device)
    width = max(counts)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32, device=device)
    start = 0
    for row, count in enumerate(counts):
        tables[row, :count] = order[start : start + count]
        start += count
    shape = (2, num_blocks, num_kv_heads, block_size, head_dim)
    return torch.randn(shape, device=device, dtype=dtype), tables


@register("attention", _attention_arguments)
def bench_attention(args: argparse.Namespace) -> list[Measurement]:
    """Decode (batch x context) and prefill (chunks after a cached prefix) through the
    Triton kernels, then the torch path on the same inputs for comparison."""
    from loraplex.kernels import paged_attention, torch_paged_attention

    device = bench_device()
    dtype = DTYPES[args.dtype]
    es = torch.empty((), dtype=dtype).element_size()
    heads, kv_heads, head_dim = args.heads, args.kv_heads, args.head_dim
    scale = head_dim**-0.5
    results = []

    lens = [args.context] * args.batch
    cache, tables = _paged_layout(lens, args.block_size, kv_heads, head_dim, dtype)
    seq_lens = torch.tensor(lens, device=device)
    q = torch.randn(args.batch, heads, head_dim, device=device, dtype=dtype)
    out = torch.empty_like(q)
    scratch: dict[str, torch.Tensor] = {}
    kv_bytes = 2 * sum(lens) * kv_heads * head_dim * es
    decode_bytes = kv_bytes + 2 * q.numel() * es
    decode_flops = 4 * heads * head_dim * sum(lens)
    shape = (
        f"D={args.batch} L={args.context} H={heads}/{kv_heads} Dh={head_dim} B={args.block_size}"
    )
    results.append(
        Measurement(
            "decode triton",
            shape,
            time_ms(
                lambda: paged_attention.decode_attention(
                    q, cache, tables, seq_lens, scale, out=out, scratch=scratch
                )
            ),
            decode_bytes,
            decode_flops,
        )
    )
    tables64 = tables.long()
    results.append(
        Measurement(
            "decode torch",
            shape,
            time_ms(
                lambda: torch_paged_attention.decode_attention(
                    q, cache, tables64, seq_lens, scale, {}
                )
            ),
            decode_bytes,
            decode_flops,
        )
    )

    query_lens = [args.chunk_len] * args.chunks
    lens = [args.prefix_len + args.chunk_len] * args.chunks
    cache, tables = _paged_layout(lens, args.block_size, kv_heads, head_dim, dtype)
    q = torch.randn(sum(query_lens), heads, head_dim, device=device, dtype=dtype)
    out = torch.empty_like(q)
    visible = sum(
        q_len * (length - q_len) + q_len * (q_len + 1) // 2
        for q_len, length in zip(query_lens, lens, strict=True)
    )
    prefill_bytes = 2 * sum(lens) * kv_heads * head_dim * es + 2 * q.numel() * es
    prefill_flops = 4 * heads * head_dim * visible
    shape = (
        f"P={args.chunks}x{args.chunk_len} after {args.prefix_len} H={heads}/{kv_heads} "
        f"Dh={head_dim} B={args.block_size}"
    )
    results.append(
        Measurement(
            "prefill triton",
            shape,
            time_ms(
                lambda: paged_attention.prefill_attention(
                    q, cache, tables, query_lens, lens, scale, out=out, scratch={}
                )
            ),
            prefill_bytes,
            prefill_flops,
        )
    )
    k = torch.randn(sum(query_lens), kv_heads, head_dim, device=device, dtype=dtype)
    tables64 = tables.long()
    results.append(
        Measurement(
            "prefill torch",
            shape,
            time_ms(
                lambda: torch_paged_attention.prefill_attention(
                    q, k, k, cache, tables64, query_lens, lens, scale, {}
                )
            ),
            prefill_bytes,
            prefill_flops,
        )
    )
    return results


# ----------------------------------------------------------------------------- fused layers


def _layer_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("rms_norm / rotary")
    group.add_argument("--tokens", type=int, default=4096, help="T, tokens in the step")
    group.add_argument("--hidden", type=int, default=4096, help="hidden size (RMSNorm)")


@register("rms_norm", _layer_arguments)
def bench_rms_norm(args: argparse.Namespace) -> list[Measurement]:
    """Fused RMSNorm + residual add against the torch ops it replaces."""
    from loraplex.kernels import torch_layers
    from loraplex.kernels.rms_norm import rms_norm

    torch_rms_norm = torch_layers.rms_norm

    device = bench_device()
    dtype = DTYPES[args.dtype]
    es = torch.empty((), dtype=dtype).element_size()
    x = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype)
    residual = torch.randn_like(x)
    weight = torch.randn(args.hidden, device=device, dtype=dtype)
    shape = f"T={args.tokens} hidden={args.hidden}"
    traffic = 4 * x.numel() * es
    flops = 4 * x.numel()
    return [
        Measurement(
            "rms_norm triton",
            shape,
            time_ms(lambda: rms_norm(x, residual, weight, 1e-6)),
            traffic,
            flops,
        ),
        Measurement(
            "rms_norm torch",
            shape,
            time_ms(lambda: torch_rms_norm(x, residual, weight, 1e-6)),
            traffic,
            flops,
        ),
    ]


@register("rotary")  # reads --tokens and the attention group's head shapes
def bench_rotary(args: argparse.Namespace) -> list[Measurement]:
    """Fused rotary + KV-cache write (Llama-8B heads) against apply_rotary + write_kv."""
    from loraplex.kernels.rotary_kv import rotary_write_kv
    from loraplex.kernels.torch_layers import apply_rotary
    from loraplex.kernels.torch_paged_attention import write_kv

    device = bench_device()
    dtype = DTYPES[args.dtype]
    es = torch.empty((), dtype=dtype).element_size()
    heads, kv_heads, head_dim, block = args.heads, args.kv_heads, args.head_dim, args.block_size
    tokens = args.tokens
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(tokens, width, device=device, dtype=dtype)
    q, k, v = qkv.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    q = q.view(tokens, heads, head_dim)
    k = k.view(tokens, kv_heads, head_dim)
    v = v.view(tokens, kv_heads, head_dim)
    angles = torch.rand(tokens, head_dim // 2, device=device) * 100
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    cache = torch.empty(
        2, -(-tokens // block), kv_heads, block, head_dim, device=device, dtype=dtype
    )
    slots = torch.randperm(cache.shape[1] * block, device=device)[:tokens]
    traffic = (2 * tokens * (heads + kv_heads) + 2 * tokens * kv_heads) * head_dim * es
    traffic += 2 * cos.numel() * es + 2 * tokens * kv_heads * head_dim * es
    flops = 6 * tokens * (heads + kv_heads) * head_dim // 2
    shape = f"T={tokens} H={heads}/{kv_heads} Dh={head_dim} B={block}"

    def torch_path() -> torch.Tensor:
        rotated_k = apply_rotary(k, cos[:, None], sin[:, None])
        write_kv(cache, rotated_k, v, slots)
        return apply_rotary(q, cos[:, None], sin[:, None])

    return [
        Measurement(
            "rotary+write triton",
            shape,
            time_ms(lambda: rotary_write_kv(q, k, v, cos, sin, cache, slots)),
            traffic,
            flops,
        ),
        Measurement("rotary+write torch", shape, time_ms(torch_path), traffic, flops),
    ]


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
        prog="python -m loraplex.tools.engine_bench.kernels", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=sorted(BENCHMARKS),
        help="run only this benchmark (repeatable; default: all)",
    )
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument(
        "--timing",
        choices=TIMINGS,
        default="events",
        help="events: wall time per call between CUDA events, launch overhead included "
        "(default); kernels: summed kernel durations per call from the profiler",
    )
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
    global _timing
    _timing = args.timing
    device_name = torch.cuda.get_device_name()
    peak = device_peak(device_name)
    sys.stdout.write(f"device: {device_name} (peak: {peak or 'unknown'}), timing: {_timing}\n")
    results: list[Measurement] = []
    for name in args.only or sorted(BENCHMARKS):
        results.extend(BENCHMARKS[name].run(args))
    sys.stdout.write(format_table(results, peak) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
