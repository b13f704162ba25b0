"""The CPU LoRA kernel at an engine's shapes: `python -m loraplex.tools.engine_bench.cpu_lora`.

Times one step's `lora_add` calls (kernels/cpu_ops.py) the way the decoder stack makes
them: every layer has its own slot stacks for its four projections (q/k/v fused, o,
gate/up fused, down), laid out by the CPU backend's `lora_stack`, so a step reads each
layer's slots from memory, not from a cache the previous call left warm. The torch path (kernels/lora.py `torch_add_lora`, grouped
matmuls over the same slots) runs in the same process as the baseline, alternating with
the native kernel, and the report gives native / torch.

Cases (tokens in slot order, as the runner sorts them):
    decode        --decode-tokens spread evenly over --slots adapters
    decode, one   the same tokens all on one adapter
    prefill       --prefill-runs runs of --prefill-len tokens, adapters round-robin
Defaults are the default model's shapes (SmolLM2-135M: 30 layers, hidden 576,
intermediate 1,536, 9 query and 3 kv heads of 64) in bf16, rank 8, 8 slots.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from loraplex.kernels.lora import LoRAStack

DTYPE_CHOICES = ("bf16", "fp16", "fp32")


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    intermediate: int
    q_size: int
    kv_size: int

    def projections(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """(in features, output sizes) of q/k/v, o, gate/up and down."""
        return (
            (self.hidden, (self.q_size, self.kv_size, self.kv_size)),
            (self.q_size, (self.hidden,)),
            (self.hidden, (self.intermediate, self.intermediate)),
            (self.intermediate, (self.hidden,)),
        )


@dataclass(frozen=True)
class CaseResult:
    name: str
    tokens: int
    native_ms: float
    torch_ms: float


def slot_stacks(
    shape: ModelShape, slots: int, rank: int, dtype: torch.dtype, seed: int = 0
) -> list[LoRAStack]:
    """Every layer's four projections' slot stacks as the CPU backend lays them out for a
    `dtype` model (`lora_stack`: fp32 slots, B rank-major), each slot holding a random
    rank-`rank` adapter packed as the slot manager packs one: slice i's outputs read
    only its own rank columns of B."""
    from loraplex.kernels.backends import get_backend

    backend = get_backend("cpu")
    gen = torch.Generator().manual_seed(seed)
    stacks = []
    for _ in range(shape.layers):
        for in_features, sizes in shape.projections():
            stack = backend.lora_stack(slots, rank, in_features, sizes, dtype, torch.device("cpu"))
            stack.a.copy_(torch.randn(stack.a.shape, generator=gen) * in_features**-0.5)
            start = 0
            for index, end in enumerate(stack.slice_ends):
                columns = slice(index * rank, (index + 1) * rank)
                block = torch.randn(slots, end - start, rank, generator=gen) * rank**-0.5
                stack.b[:, start:end, columns] = block
                start = end
            stacks.append(stack)
    return stacks


def case_slots(name: str, args: argparse.Namespace) -> tuple[list[int], int]:
    """(each token's slot, how many of them are decodes) for a case."""
    if name == "decode":
        tokens = args.decode_tokens
        return [t * args.slots // tokens for t in range(tokens)], tokens
    if name == "decode, one":
        return [0] * args.decode_tokens, args.decode_tokens
    runs = [g % args.slots for g in range(args.prefill_runs) for _ in range(args.prefill_len)]
    return runs, 0


def median_ms(fn: Callable[[], None], rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run_case(
    name: str, args: argparse.Namespace, stacks: Sequence[LoRAStack], dtype: torch.dtype
) -> CaseResult:
    from loraplex.kernels.lora import LoRABatch, cpu_add_lora, torch_add_lora

    slots, decodes = case_slots(name, args)
    batch = LoRABatch.from_token_slots(
        slots, decodes, torch.device("cpu"), slot_ranks=[args.rank] * args.slots
    )
    gen = torch.Generator().manual_seed(1)
    widths = {stack.a.size(2) for stack in stacks} | {stack.slice_ends[-1] for stack in stacks}
    rows = {w: (torch.randn(len(slots), w, generator=gen) * 0.1).to(dtype) for w in widths}
    outs = {w: torch.zeros(len(slots), w, dtype=dtype) for w in widths}

    def native() -> None:
        for s in stacks:
            out, x = outs[s.slice_ends[-1]], rows[s.a.size(2)]
            cpu_add_lora(out, x, s.a, s.b, batch, s.slice_ends)

    def torch_path() -> None:
        for s in stacks:
            out, x = outs[s.slice_ends[-1]], rows[s.a.size(2)]
            torch_add_lora(out, x, s.a, s.b, batch, len(s.slice_ends))

    native_times, torch_times = [], []
    for _ in range(args.rounds):
        native_times.append(median_ms(native, args.repeats))
        torch_times.append(median_ms(torch_path, args.repeats))
    return CaseResult(
        name, len(slots), statistics.median(native_times), statistics.median(torch_times)
    )


def format_report(results: Sequence[CaseResult], args: argparse.Namespace) -> str:
    from loraplex.tools.engine_bench.offline import cpu_model, read_loadavg

    lines = [
        f"machine: {cpu_model()}, torch threads {torch.get_num_threads()}; "
        f"loadavg {read_loadavg()}",
        f"shape: {args.layers} layers x 4 projections, hidden {args.hidden}, intermediate "
        f"{args.intermediate}, q {args.q_size}, kv {args.kv_size}, {args.dtype}, rank "
        f"{args.rank}, {args.slots} slots (each layer's own, read cold)",
        f"{'case':<14}{'tokens':>8}{'native ms':>12}{'torch ms':>12}{'native/torch':>14}",
    ]
    for r in results:
        ratio = r.native_ms / r.torch_ms
        lines.append(
            f"{r.name:<14}{r.tokens:>8}{r.native_ms:>12.2f}{r.torch_ms:>12.2f}{ratio:>13.2f}x"
        )
    return "\n".join(lines) + "\n"


CASES = ("decode", "decode, one", "prefill")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="bf16")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--q-size", type=int, default=576)
    parser.add_argument("--kv-size", type=int, default=192)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--prefill-runs", type=int, default=16)
    parser.add_argument("--prefill-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the two paths")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per round")
    parser.add_argument("--only", choices=CASES, action="append")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from loraplex.kernels import cpu_ops
    from loraplex.platform.config import parse_dtype

    args = build_parser().parse_args(argv)
    if not cpu_ops.load():
        sys.stdout.write("the native CPU ops could not be built here; nothing to time\n")
        return 1
    shape = ModelShape(args.layers, args.hidden, args.intermediate, args.q_size, args.kv_size)
    dtype = parse_dtype(args.dtype)
    stacks = slot_stacks(shape, args.slots, args.rank, dtype)
    results = [run_case(name, args, stacks, dtype) for name in args.only or CASES]
    sys.stdout.write(format_report(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
