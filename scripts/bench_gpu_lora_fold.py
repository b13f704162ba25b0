"""Would folding the LoRA shrink into the base projection pay on a GPU? A decode step's
projections timed three ways inside one CUDA graph, at the Llama-3.2-1B shapes:

    base      y = x @ W.T for each projection of each layer (what a base step runs)
    separate  the same, plus the shrink of every slot as its own matmul, s = x @ A_all
              (what a decode graph runs today before its expand: triton_lora.dense_shrink)
    folded    one matmul per projection over W with every slot's A rows appended,
              [y | s] = x @ [W; A_all.T].T (the shrink costs no kernel of its own)

Semantics: x [T, K], W [N, K], A_all [K, L * S * R] (L slots, S output slices, rank R);
the expand (the same in both LoRA variants) is not timed. Each variant is captured once
over every layer (distinct weights per layer, so no layer reads another's from cache)
and replayed; the figure is the median replay time over `--repeats`, in us per step,
with the LoRA variants' cost over base.

    python scripts/bench_gpu_lora_fold.py [--tokens 8,64] [--slots 8] [--rank 16]
    python scripts/bench_gpu_lora_fold.py --smoke     # tiny shapes, eager, any device
"""

from __future__ import annotations

import argparse
import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger("bench_gpu_lora_fold")

HIDDEN, INTERMEDIATE, LAYERS = 2048, 8192, 16
"""Llama-3.2-1B: hidden 2048, MLP 8192, 16 layers, 32 query and 8 KV heads of 64."""


@dataclass(frozen=True)
class Projection:
    name: str
    out_features: int
    in_features: int
    slices: int


def projections(hidden: int, intermediate: int) -> tuple[Projection, ...]:
    kv = hidden // 4
    return (
        Projection("qkv", hidden + 2 * kv, hidden, 3),
        Projection("o", hidden, hidden, 1),
        Projection("gate_up", 2 * intermediate, hidden, 2),
        Projection("down", hidden, intermediate, 1),
    )


@dataclass
class LayerWeights:
    base: dict[str, torch.Tensor]
    shrink: dict[str, torch.Tensor]
    folded: dict[str, torch.Tensor]


def make_layers(
    shapes: tuple[Projection, ...], layers: int, slots: int, rank: int, device: str
) -> list[LayerWeights]:
    made = []
    for _ in range(layers):
        base, shrink, folded = {}, {}, {}
        for p in shapes:
            columns = slots * p.slices * rank
            w = torch.randn(p.out_features, p.in_features, device=device, dtype=torch.bfloat16)
            a = torch.randn(p.in_features, columns, device=device, dtype=torch.bfloat16)
            base[p.name] = w
            shrink[p.name] = a
            folded[p.name] = torch.cat([w, a.t()]).contiguous()
        made.append(LayerWeights(base, shrink, folded))
    return made


def step(
    variant: str, layers: list[LayerWeights], inputs: dict[str, torch.Tensor]
) -> Callable[[], None]:
    """One decode step's projections in `variant` (see the module docstring)."""

    def run() -> None:
        for layer in layers:
            for name, x in inputs.items():
                if variant == "folded":
                    torch.mm(x, layer.folded[name].t())
                else:
                    torch.mm(x, layer.base[name].t())
                    if variant == "separate":
                        torch.mm(x, layer.shrink[name])

    return run


def time_graph(run: Callable[[], None], repeats: int) -> float:
    """Median microseconds of one replay of `run` captured as a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def bench(args: argparse.Namespace) -> list[str]:
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    hidden, intermediate, count = (HIDDEN, INTERMEDIATE, LAYERS)
    if args.smoke:
        hidden, intermediate, count = 64, 128, 2
    shapes = projections(hidden, intermediate)
    layers = make_layers(shapes, count, args.slots, args.rank, device)
    lines = [
        f"{torch.cuda.get_device_name() if device == 'cuda' else 'CPU (smoke)'}: "
        f"{count} layers, {args.slots} slots of rank {args.rank}, bf16, us per step"
    ]
    for tokens in (int(t) for t in args.tokens.split(",")):
        inputs = {
            p.name: torch.randn(tokens, p.in_features, device=device, dtype=torch.bfloat16)
            for p in shapes
        }
        figures = {}
        for variant in ("base", "separate", "folded"):
            run = step(variant, layers, inputs)
            if device == "cuda":
                figures[variant] = time_graph(run, args.repeats)
            else:
                run()
                figures[variant] = 0.0
        lines.append(
            f"T={tokens}: base {figures['base']:.1f}, separate {figures['separate']:.1f} "
            f"(+{figures['separate'] - figures['base']:.1f}), folded {figures['folded']:.1f} "
            f"(+{figures['folded'] - figures['base']:.1f})"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,8,64", help="decode rows per step, comma list")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, eager (no timing)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logger.info("\n".join(bench(args)))


if __name__ == "__main__":
    main()
