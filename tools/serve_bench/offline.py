"""The offline baseline of a serve benchmark: the same requests through the engine
directly (`LLMEngine.step` in a loop), with the same engine options as the served
model, in a separate process (`python -m loraplex.tools.serve_bench.offline SPEC OUT`)
so that neither run warms or slows the other.

It measures what the served figures are compared with:
- output tok/s of the whole workload, every request added at once;
- when each request got its first token (the time to finish prefilling them all is
  the last of those);
- the batch-1 decode step: one request alone, the mean time per token after its first.
An untimed warm-up (prompts outside the workload, one step's token budget of them)
comes first, as it does in the served app before it reports ready.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OfflineSpec:
    """What the child process runs; written as JSON by the parent."""

    model: str
    engine: dict
    """Engine options (EngineConfig.from_options), as in the serve config."""
    prompts: list[list[int]]
    adapters: list[str | None]
    """Each prompt's adapter folder (None: the base model)."""
    output_len: int
    warmup_prompts: list[list[int]]


@dataclass(frozen=True)
class OfflineResult:
    output_tokens: int
    elapsed_s: float
    output_tok_s: float
    first_token_s: list[float]
    """Per request, seconds from the start until its first token."""
    prefill_done_s: float
    """When the last request got its first token."""
    batch1_decode_step_s: float
    """One request alone: mean seconds per token after the first."""
    threads: int


def _run_all(engine, prompts, adapters, params, tag: str) -> tuple[float, list[float], int]:
    """Adds every prompt at once and steps until all finish; (elapsed, first-token times,
    tokens generated)."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    loras = [engine.load_adapter(a) for a in adapters]
    started = time.perf_counter()
    for request_id, prompt, lora in zip(ids, prompts, loras, strict=True):
        engine.add_group(engine.make_request_group(request_id, prompt, params, lora=lora))
    first: dict[str, float] = {}
    tokens: dict[str, int] = {}
    while engine.has_unfinished():
        for output in engine.step():
            count = len(output.outputs[0].token_ids)
            if count and output.request_id not in first:
                first[output.request_id] = time.perf_counter() - started
            tokens[output.request_id] = count
    elapsed = time.perf_counter() - started
    return elapsed, [first[i] for i in ids], sum(tokens.values())


def _batch1_step(engine, prompt, params) -> float:
    """Mean time per decode step of one request running alone."""
    engine.add_group(engine.make_request_group("batch1", prompt, params))
    stamps = []
    while engine.has_unfinished():
        if engine.step():
            stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return sum(gaps) / len(gaps) if gaps else 0.0


def run(spec: OfflineSpec) -> OfflineResult:
    import torch

    from loraplex.platform.config import EngineConfig
    from loraplex.platform.engine import LLMEngine
    from loraplex.platform.request import SamplingParams

    engine = LLMEngine(EngineConfig.from_options(spec.model, spec.engine))
    params = SamplingParams(temperature=0.0, max_tokens=spec.output_len, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    _run_all(engine, spec.warmup_prompts, [None] * len(spec.warmup_prompts), warm, "warmup")
    elapsed, first, tokens = _run_all(engine, spec.prompts, spec.adapters, params, "bench")
    step = _batch1_step(engine, spec.warmup_prompts[0], params)
    return OfflineResult(
        output_tokens=tokens,
        elapsed_s=elapsed,
        output_tok_s=tokens / elapsed,
        first_token_s=first,
        prefill_done_s=max(first),
        batch1_decode_step_s=step,
        threads=torch.get_num_threads(),
    )


def run_in_subprocess(spec: OfflineSpec, workdir: Path) -> OfflineResult:
    """Runs `run(spec)` in a fresh Python process; raises with its output on failure."""
    import subprocess

    spec_path, out_path = Path(workdir) / "offline-spec.json", Path(workdir) / "offline.json"
    spec_path.write_text(json.dumps(asdict(spec)))
    completed = subprocess.run(
        [sys.executable, "-m", "loraplex.tools.serve_bench.offline", str(spec_path), str(out_path)],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    if completed.returncode != 0:
        raise RuntimeError(f"offline baseline failed:\n{completed.stderr[-3000:]}")
    return OfflineResult(**json.loads(out_path.read_text()))


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING)
    spec = OfflineSpec(**json.loads(Path(argv[0]).read_text()))
    Path(argv[1]).write_text(json.dumps(asdict(run(spec))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
