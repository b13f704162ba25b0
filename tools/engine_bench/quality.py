"""`loraplex bench offline --quality`: what an engine option (int8 quantization, a
dtype) costs in quality, against the same model in a reference dtype:

    perplexity   exp(-mean logprob) of the shipped text (data/quality_text.txt), each
                 token scored given the ones before it, in windows of `window` tokens
                 (prompt logprobs, teacher-forced)
    agreement    the share of greedy tokens equal to the reference's, over `prompts`
                 prompts cut from the same text, each continued `output_len` tokens;
                 a prompt counts its tokens up to its first difference (after it the
                 two continue different texts)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TEXT = Path(__file__).resolve().parent / "data" / "quality_text.txt"


@dataclass(frozen=True)
class Quality:
    name: str
    perplexity: float
    tokens_scored: int
    agreement: float
    """Greedy tokens equal to the reference's before the first difference, per token."""


def score(llm, token_ids: list[int], window: int) -> tuple[float, int]:
    """(summed logprob, tokens scored) of `token_ids` in consecutive windows."""
    from loraplex.platform.request import SamplingParams

    windows = [token_ids[i : i + window] for i in range(0, len(token_ids), window)]
    windows = [w for w in windows if len(w) > 1]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    total, count = 0.0, 0
    for output in llm.generate(windows, params):
        for entry in output.prompt_logprobs[1:]:
            total += entry.logprob
            count += 1
    return total, count


def greedy(llm, prompts: list[list[int]], output_len: int) -> list[list[int]]:
    from loraplex.platform.request import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    return [output.token_ids for output in llm.generate(prompts, params)]


def agreement(reference: list[list[int]], other: list[list[int]]) -> float:
    matched = total = 0
    for want, got in zip(reference, other, strict=True):
        total += len(want)
        for a, b in zip(want, got, strict=True):
            if a != b:
                break
            matched += 1
    return matched / total if total else 1.0


def run_quality(
    model: str,
    variants: dict[str, dict[str, Any]],
    window: int = 128,
    prompts: int = 8,
    output_len: int = 32,
) -> list[Quality]:
    """Each variant's engine options (the first is the reference), scored in turn; one
    engine at a time is held."""
    from loraplex.platform.llm import LLM

    results: list[Quality] = []
    reference_outputs: list[list[int]] | None = None
    cut: list[list[int]] = []
    for name, options in variants.items():
        llm = LLM(model=model, **options)
        ids = llm.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
        if not cut:
            step = max(1, (len(ids) - 32) // prompts)
            cut = [ids[i * step : i * step + 24] for i in range(prompts)]
        total, count = score(llm, ids, window)
        outputs = greedy(llm, cut, output_len)
        if reference_outputs is None:
            reference_outputs = outputs
        results.append(
            Quality(name, math.exp(-total / count), count, agreement(reference_outputs, outputs))
        )
        llm.engine.shutdown()
    return results


def format_quality(model: str, results: list[Quality]) -> str:
    reference = results[0]
    lines = [
        f"model {model}: perplexity of {TEXT.name} ({reference.tokens_scored} tokens) and "
        f"greedy agreement with {reference.name}",
        "",
        "| engine | perplexity | vs reference | greedy agreement |",
        "|---|---:|---:|---:|",
    ]
    for result in results:
        ratio = result.perplexity / reference.perplexity
        lines.append(
            f"| {result.name} | {result.perplexity:.3f} | {ratio:.4f}x | {result.agreement:.1%} |"
        )
    return "\n".join(lines) + "\n"
