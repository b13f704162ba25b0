"""The SGMV / BGMV LoRA kernels at one model's projection shapes, as the engine runs them
on a GPU: device time per call inside a CUDA graph (what a decode graph's replay pays),
for the launch options each kernel takes, per projection and summed over a layer.

Two workloads per projection (fused q/k/v and gate/up stack their slices' ranks):
- decode: 64 decodes over 8 adapters (8 rows each), read as a decode graph reads them:
  a segment table of `max_loras` entries sized for the worst case (max_seg_len = 64);
  BGMV over the same tokens for reference;
- prefill: 8 segments of 1024 tokens.

Where the engine folds the shrink into the projection (Triton backend), the expand runs
inside the kernel reading the output: the RMSNorm after o and down (`rms_norm` with the
pending expand, timed in its one-pass and two-pass forms), the SiLU-and-mul after gate/up; those rows
time each against the expand kernel plus the plain kernel it replaces.

Each variant is captured `--reps` times into one CUDA graph; the figure is the replay
time over the calls (median of 5 replays), so a kernel's launch latency inside a graph
is counted and the host's is not. Needs CUDA.

    python scripts/bench_gpu_lora_shapes.py [--model llama-1b] [--rank 16]
"""

from __future__ import annotations

import argparse
import functools
import logging
import statistics
from collections.abc import Callable

import torch

from loraplex.kernels import rms_norm, silu_and_mul, torch_layers, triton_lora
from loraplex.kernels.lora import PendingExpand

logger = logging.getLogger("bench_gpu_lora_shapes")

MODELS = {
    # name: (hidden, intermediate, q heads x head dim, kv heads x head dim)
    "llama-1b": (2048, 8192, 2048, 512),
    "llama-8b": (4096, 14336, 4096, 1024),
}


def projections(model: str, rank: int) -> dict[str, tuple[int, int, int]]:
    """name -> (in features, out features, stacked rank columns)."""
    hidden, inter, q, kv = MODELS[model]
    return {
        "qkv": (hidden, q + 2 * kv, 3 * rank),
        "o": (q, hidden, rank),
        "gate_up": (hidden, 2 * inter, 2 * rank),
        "down": (inter, hidden, rank),
    }


def graph_us(call: Callable[[], None], reps: int) -> float:
    """Device microseconds per call of `call`, replayed inside a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(times)


def segments(lengths: list[int], table: int, device: torch.device) -> tuple:
    """(starts, lens, slots, max_seg_len) of consecutive segments, slot g for segment g,
    padded to `table` entries (length 0, slot -1) as a decode graph's table is."""
    starts, offset = [], 0
    for length in lengths:
        starts.append(offset)
        offset += length
    pad = table - len(lengths)
    as_int32 = {"dtype": torch.int32, "device": device}
    return (
        torch.tensor(starts + [0] * pad, **as_int32),
        torch.tensor(lengths + [0] * pad, **as_int32),
        torch.tensor(list(range(len(lengths))) + [-1] * pad, **as_int32),
    )


def bench_workload(
    name: str, shape: tuple[int, int, int], lengths: list[int], max_seg_len: int, reps: int
) -> list[tuple[str, float]]:
    """(variant, us per call) of every kernel variant on one projection and workload."""
    k_dim, n_dim, rank = shape
    device, dtype, slots = torch.device("cuda"), torch.bfloat16, len(lengths)
    lora_a = (torch.randn(slots, rank, k_dim, device=device) * k_dim**-0.5).to(dtype)
    lora_b = (torch.randn(slots, n_dim, rank, device=device) * rank**-0.5).to(dtype)
    tokens = sum(lengths)
    x = torch.randn(tokens, k_dim, device=device).to(dtype)
    out = torch.randn(tokens, n_dim, device=device).to(dtype)
    weight = torch.randn(n_dim, k_dim, device=device).to(dtype)
    y = torch.zeros(tokens, rank, device=device)
    segs = (*segments(lengths, slots, device), max_seg_len)
    token_slots = torch.repeat_interleave(
        torch.arange(slots, device=device), torch.tensor(lengths, device=device)
    )
    variants: dict[str, Callable[[], object]] = {}
    for split in (None, 1, 2, 4, 8, 16):
        variants[f"shrink split_k={split or 'auto'}"] = functools.partial(
            triton_lora.sgmv_shrink, x, lora_a, *segs, y, split_k=split
        )
    for block_m, block_n in ((None, None), (16, 64), (16, 128), (16, 256), (64, 128), (64, 256)):
        variants[f"expand block_m={block_m or 'auto'} block_n={block_n or 'auto'}"] = (
            functools.partial(
                triton_lora.sgmv_expand, y, lora_b, *segs, out, block_m=block_m, block_n=block_n
            )
        )
    if tokens <= 256:
        variants["bgmv shrink"] = functools.partial(
            triton_lora.bgmv_shrink, x, lora_a, token_slots, y
        )
        variants["bgmv expand"] = functools.partial(
            triton_lora.bgmv_expand, y, lora_b, token_slots, out
        )
        y_slots = triton_lora.dense_shrink(x, lora_a)
        variants["dense shrink"] = functools.partial(triton_lora.dense_shrink, x, lora_a)
        variants["expand per-slot y"] = functools.partial(
            triton_lora.sgmv_expand, y_slots, lora_b, *segs, out
        )
    variants["base gemm"] = functools.partial(torch.mm, x, weight.T)
    variants.update(
        epilogues(name, out, triton_lora.dense_shrink(x, lora_a), lora_b, token_slots, segs)
    )
    return [(label, graph_us(call, reps)) for label, call in variants.items()]


def epilogues(
    name: str,
    out: torch.Tensor,
    y_slots: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    segs: tuple,
) -> dict[str, Callable[[], object]]:
    """The consumer of the projection's output alone, after the expand kernel, and with
    the expand inside it: RMSNorm (with a residual) after o and down, SiLU-and-mul after
    gate/up; nothing for q/k/v (its expand stays a kernel)."""
    variants: dict[str, Callable[[], object]] = {}

    def then(first: Callable[[], object], second: Callable[[], object]) -> Callable[[], None]:
        def both() -> None:
            first()
            second()

        return both

    expand = functools.partial(triton_lora.sgmv_expand, y_slots, lora_b, *segs, out)
    pending = PendingExpand(y_slots, lora_b, token_slots)
    if name in ("o", "down"):
        weight = torch.randn(out.shape[1], device=out.device).to(out.dtype)
        residual = torch.randn_like(out)
        norm = functools.partial(rms_norm.rms_norm, out, residual, weight, 1e-5)
        variants["norm alone"] = norm
        variants["expand kernel + norm"] = then(expand, norm)
        for one_pass in (True, False):
            variants[f"norm with expand, one_pass={one_pass}"] = functools.partial(
                rms_norm.rms_norm, out, residual, weight, 1e-5, pending, one_pass=one_pass
            )
    elif name == "gate_up":
        torch_silu = functools.partial(torch_layers.silu_and_mul, out)
        variants["silu_and_mul torch"] = torch_silu
        variants["silu_and_mul triton"] = functools.partial(silu_and_mul.silu_and_mul, out)
        variants["expand kernel + silu_and_mul torch"] = then(expand, torch_silu)
        variants["silu_and_mul with expand"] = functools.partial(
            silu_and_mul.silu_and_mul, out, pending
        )
    return variants


def bench(args: argparse.Namespace) -> None:
    rows: list[tuple[str, str, str, float]] = []
    for name, shape in projections(args.model, args.rank).items():
        for workload, lengths, max_seg_len in (
            ("decode", [8] * 8, 64),
            ("prefill", [1024] * 8, 1024),
        ):
            for label, us in bench_workload(name, shape, lengths, max_seg_len, args.reps):
                rows.append((name, workload, label, us))
    lines = [f"{torch.cuda.get_device_name()}, {args.model}, rank {args.rank}, bf16, us per call"]
    for name, workload, label, us in rows:
        lines.append(f"{name:8} {workload:8} {label:40} {us:8.2f}")
    for workload in ("decode", "prefill"):
        totals: dict[str, float] = {}
        for _, kind, label, us in rows:
            if kind == workload:
                totals[label] = totals.get(label, 0.0) + us
        for label, total in sorted(totals.items()):
            lines.append(f"layer    {workload:8} {label:40} {total:8.2f}")
    logger.info("\n%s", "\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-1b", choices=sorted(MODELS))
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    bench(args)


if __name__ == "__main__":
    main()
