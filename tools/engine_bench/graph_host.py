"""Host time of a decode step on the CUDA-graph path, measured on a CPU:
`python -m loraplex.tools.engine_bench.graph_host`.

On a GPU a decode step replays one captured graph (platform/decode_graphs.py), and what
is left on the host is Python: the scheduler, the runner's inputs for the graph, the
sampler's bookkeeping, appending tokens, detokenizing, stop checks and building each
request's output. At a full batch that host time is what bounds a GPU's decode
throughput (docs/benchmarks.md, "On a GPU"). This tool times that same Python on a CPU:
an engine with the plain torch kernels and `DecodeGraphs` attached, whose `run` off the
GPU is the eager forward over the graphs' static buffers. It runs a model with the
tokenizer and vocabulary of `--tokenizer-from` (the default model) but only two tiny
layers, and times every decode step. It subtracts the time inside `DecodeGraphs.run`
(the forward a graph would replay) and inside the greedy sampling kernel. What is left
is the host time per step.

Per batch size: B prompts of 32 tokens generate `--output-len` tokens each (greedy, EOS
ignored, delta outputs as a model server asks), after one warm-up run; the median of
`--rounds` runs. Compare two trees by running the tool from each, alternating.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loraplex.kernels.selection import KERNEL_BACKEND_ENV
from loraplex.platform.model_files import resolve_model_folder
from loraplex.tools.engine_bench.offline import MachineInfo, read_loadavg

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8] * 4


@dataclass(frozen=True)
class GraphHostFigure:
    batch: int
    host_us: float
    """Median host time per decode step outside the forward and the greedy kernel."""
    step_us: float
    """Median wall time per decode step (the forward and sampling included)."""
    rounds: list[float]


def save_tiny_model(tokenizer_from: Path, out: Path, seed: int = 0) -> Path:
    """A seeded random two-layer Llama with `tokenizer_from`'s vocabulary and tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tokenizer_from)
    config.num_hidden_layers = 2
    config.hidden_size = 64
    config.intermediate_size = 128
    config.num_attention_heads = 4
    config.num_key_value_heads = 2
    config.head_dim = 16
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).is_file():
            (out / name).write_bytes((tokenizer_from / name).read_bytes())
    return out


@dataclass
class _Excluded:
    """What a run spent where a GPU would not spend host time."""

    seconds: float = 0.0
    """Inside `DecodeGraphs.run` (the forward a graph replays) and the greedy kernel."""
    graph_runs: int = 0


class _TimedBackend:
    """The sampler's kernel backend with the time inside `greedy_tokens` counted."""

    def __init__(self, inner: Any, excluded: _Excluded) -> None:
        self._inner = inner
        self._excluded = excluded

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def greedy_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        result = self._inner.greedy_tokens(logits)
        self._excluded.seconds += time.perf_counter() - started
        return result


def build_engine(model: Path, max_batch: int) -> tuple[Any, _Excluded]:
    """The engine with decode graphs attached, and what its runs spend in the forward
    and the greedy kernel."""
    from loraplex.platform.decode_graphs import DecodeGraphs
    from loraplex.platform.layers.linear import has_folded_projections
    from loraplex.platform.llm import LLM

    forced = os.environ.get(KERNEL_BACKEND_ENV)
    os.environ[KERNEL_BACKEND_ENV] = "torch"  # read once, while the engine is built
    try:
        engine = LLM(
            str(model), dtype="float32", max_model_len=512, device="cpu", max_num_seqs=max_batch
        ).engine
    finally:
        if forced is None:
            del os.environ[KERNEL_BACKEND_ENV]
        else:
            os.environ[KERNEL_BACKEND_ENV] = forced
    graphs = DecodeGraphs(
        engine.runner.decode_logits,
        engine.device,
        engine.config.cache.block_size,
        engine.max_model_len,
        max_batch=max_batch,
        max_loras=1,
        kernels=engine.kernel_backend,
        folded_shrink=has_folded_projections(engine.runner.model),
    )
    excluded = _Excluded()
    replay = graphs.run

    def timed_run(step):
        started = time.perf_counter()
        logits = replay(step)
        excluded.seconds += time.perf_counter() - started
        excluded.graph_runs += 1
        return logits

    graphs.run = timed_run
    engine.runner.graphs = graphs
    engine.runner.sampler.kernels = _TimedBackend(engine.runner.sampler.kernels, excluded)
    return engine, excluded


def time_decodes(
    engine: Any, excluded: _Excluded, batch: int, output_len: int
) -> tuple[float, float]:
    """(host, wall) seconds per decode step of one run of `batch` requests; RuntimeError
    when a decode step did not go through the graphs (its forward would count as host)."""
    from loraplex.platform.request import DELTA, SamplingParams

    params = SamplingParams(
        max_tokens=output_len, ignore_eos=True, temperature=0.0, output_kind=DELTA
    )
    for i in range(batch):
        engine.add_request(f"graph-host-{time.monotonic_ns()}-{i}", PROMPT, params)
    engine.step()  # the prefill: not a graph step
    excluded.seconds, excluded.graph_runs = 0.0, 0
    steps = 0
    started = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    wall = time.perf_counter() - started
    if excluded.graph_runs != steps:
        missed = steps - excluded.graph_runs
        raise RuntimeError(f"{missed} of {steps} decode steps ran outside the graphs")
    return (wall - excluded.seconds) / steps, wall / steps


def run(
    tokenizer_from: Path, batches: list[int], output_len: int, rounds: int
) -> list[GraphHostFigure]:
    figures = []
    with tempfile.TemporaryDirectory(prefix="graph-host-") as folder:
        model = save_tiny_model(tokenizer_from, Path(folder))
        engine, excluded = build_engine(model, max(batches))
        for batch in batches:
            time_decodes(engine, excluded, batch, min(output_len, 8))
            runs = [time_decodes(engine, excluded, batch, output_len) for _ in range(rounds)]
            host = [h * 1e6 for h, _ in runs]
            figures.append(
                GraphHostFigure(
                    batch,
                    statistics.median(host),
                    statistics.median(w * 1e6 for _, w in runs),
                    host,
                )
            )
    return figures


def format_report(figures: list[GraphHostFigure], loadavg: tuple[str, str]) -> str:
    machine = MachineInfo.collect()
    lines = [
        f"machine: {machine.processor}, {machine.cpu_count} cpus, torch threads "
        f"{machine.torch_threads}; loadavg before {loadavg[0]}, after {loadavg[1]}",
        "decode steps on the graph path, host time outside the forward and greedy kernel:",
    ]
    for f in figures:
        rounds = ", ".join(f"{r:.0f}" for r in f.rounds)
        lines.append(
            f"  batch {f.batch:>3}: host {f.host_us:7.0f} us/step ({f.host_us / f.batch:.1f} "
            f"per sequence; rounds {rounds}), step {f.step_us:.0f} us"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tokenizer-from",
        default="smollm2-135m-instruct",
        help="model folder or registered name whose tokenizer and vocabulary to use",
    )
    parser.add_argument("--batches", default="1,64", help="comma-separated batch sizes")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    before = read_loadavg()
    figures = run(
        resolve_model_folder(args.tokenizer_from),
        [int(b) for b in args.batches.split(",")],
        args.output_len,
        args.rounds,
    )
    sys.stdout.write(format_report(figures, (before, read_loadavg())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
