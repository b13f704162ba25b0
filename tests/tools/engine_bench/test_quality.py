"""`bench offline --quality` (tools/engine_bench/quality.py): perplexity of the shipped
text and greedy agreement against a reference engine."""

from __future__ import annotations

import math

from loraplex.tools.engine_bench.quality import TEXT, agreement, format_quality, run_quality


def test_agreement_counts_tokens_up_to_the_first_difference():
    assert agreement([[1, 2, 3, 4]], [[1, 2, 9, 4]]) == 0.5
    assert agreement([[1, 2], [3, 4]], [[1, 2], [3, 4]]) == 1.0


def test_the_same_engine_twice_agrees_fully_and_int8_is_scored(tiny_model_factory):
    base = str(tiny_model_factory("llama"))
    variants = {
        "float32": {"dtype": "float32"},
        "again": {"dtype": "float32"},
        "int8": {"dtype": "float32", "quantization": "int8"},
    }
    results = run_quality(base, variants, window=64, prompts=3, output_len=8)
    reference, again, int8 = results
    assert reference.tokens_scored > 100 and math.isfinite(reference.perplexity)
    assert again.perplexity == reference.perplexity and again.agreement == 1.0
    assert int8.perplexity != reference.perplexity and 0.0 <= int8.agreement <= 1.0
    report = format_quality(base, results)
    assert TEXT.name in report and "| int8 |" in report
