"""The serve bench's workload (exact lengths, shared prefix, models, arrivals, datasets)
and its figures (percentiles, failures, Retry-After, timeline), without a server."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest

from loraplex.tools.serve_bench.client import RequestRecord
from loraplex.tools.serve_bench.report import (
    BenchMeta,
    first_burst_figures,
    percentile,
    summarize,
    throughput_timeline,
    write_json,
)
from loraplex.tools.serve_bench.server_counters import ServerCounters
from loraplex.tools.serve_bench.workload import (
    WorkloadSpec,
    arrival_offsets,
    build_requests,
    model_names,
    parse_popularity,
    zipf_weights,
)

POOL = list(range(10, 60))


def test_random_prompts_have_exact_lengths_a_shared_prefix_and_round_robin_models():
    spec = WorkloadSpec(7, 12, 5, ("b:x", "b:y", "b"), prefix_len=4, seed=3)
    requests = build_requests(spec, POOL)
    assert [r.prompt_len for r in requests] == [16] * 7
    assert len({tuple(r.prompt[:4]) for r in requests}) == 1
    assert len({tuple(r.prompt[4:]) for r in requests}) == 7
    assert [r.model for r in requests] == ["b:x", "b:y", "b"] * 2 + ["b:x"]
    assert all(set(r.prompt) <= set(POOL) and r.output_len == 5 for r in requests)
    assert build_requests(spec, POOL) == requests
    assert build_requests(WorkloadSpec(7, 12, 5, ("b",), seed=4), POOL) != requests


def test_zipf_popularity_favours_the_first_models_as_the_law_says():
    models = tuple(f"b:a{i}" for i in range(8))
    spec = WorkloadSpec(4000, 4, 2, models, seed=5, zipf_s=1.1)
    requests = build_requests(spec, POOL)
    counts = [sum(r.model == m for r in requests) for m in models]
    weights = zipf_weights(8, 1.1)
    assert sum(weights) == pytest.approx(1.0)
    assert weights[0] / weights[1] == pytest.approx(2**1.1)
    for count, weight in zip(counts, weights, strict=True):
        assert count / 4000 == pytest.approx(weight, abs=0.02)
    assert build_requests(spec, POOL) == requests
    assert parse_popularity("zipf:1.1") == 1.1 and parse_popularity("uniform") is None
    with pytest.raises(ValueError, match="zipf:S"):
        parse_popularity("zipf")
    with pytest.raises(ValueError, match="zipf exponent"):
        WorkloadSpec(1, 1, 1, ("m",), zipf_s=0)


def test_prefix_groups_give_each_request_one_of_several_shared_prefixes():
    spec = WorkloadSpec(60, 5, 2, ("b",), prefix_len=8, prefix_groups=3, seed=2)
    requests = build_requests(spec, POOL)
    prefixes = [tuple(r.prompt[:8]) for r in requests]
    assert len(set(prefixes)) == 3 and all(r.prompt_len == 13 for r in requests)
    assert min(prefixes.count(p) for p in set(prefixes)) > 5
    with pytest.raises(ValueError, match="prefix_groups"):
        WorkloadSpec(1, 1, 1, ("m",), prefix_groups=0)


def test_model_names():
    assert model_names("base", []) == ("base",)
    assert model_names("base", ["a", "base:b"]) == ("base:a", "base:b")


def test_poisson_arrivals_are_seeded_increasing_and_at_the_rate():
    offsets = arrival_offsets(4000, 50.0, random.Random(1))
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert offsets == arrival_offsets(4000, 50.0, random.Random(1))
    assert 4000 / offsets[-1] == pytest.approx(50.0, rel=0.1)
    assert arrival_offsets(3, math.inf, random.Random(1)) == [0.0, 0.0, 0.0]


def test_dataset_prompts_and_bad_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "hi", "output_len": 3}) + "\n\n" + '{"prompt": [1, 2]}\n')
    requests = build_requests(WorkloadSpec(3, 0, 9, ("m",), dataset=path), POOL)
    assert [(r.prompt, r.output_len) for r in requests] == [("hi", 3), ([1, 2], 9), ("hi", 3)]
    assert requests[0].prompt_len is None and requests[1].prompt_len == 2
    path.write_text('{"prompt": "x"}\n{"text": "y"}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:2"):
        build_requests(WorkloadSpec(1, 0, 2, ("m",), dataset=path), POOL)
    with pytest.raises(ValueError, match="request_rate"):
        WorkloadSpec(1, 1, 1, ("m",), request_rate=0)


def test_percentile_matches_linear_interpolation():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == pytest.approx(4.6)
    assert percentile(values, 99) == pytest.approx(4.96)
    assert math.isnan(percentile([], 50))


def record(index, chunks, tokens, status=200, error=None, retry_after=None, sent=0.0):
    return RequestRecord(
        index, "m", 4, sent_s=sent, chunk_s=chunks, end_s=(chunks or [sent])[-1] + 0.01,
        output_tokens=tokens, status=status, error=error, retry_after=retry_after,
    )  # fmt: skip


def test_summary_counts_tokens_failures_and_missing_retry_after():
    records = [
        record(0, [0.1, 0.2, 0.3], 3),
        record(1, [0.5, 0.7], 2, sent=0.2),
        record(2, [], 0, status=503, error="busy", retry_after="2"),
        record(3, [], 0, status=429, error="slow down"),
        record(4, [], 0, status=0, error="timeout"),
    ]
    summary = summarize("b", records)
    assert summary.completed == 2 and summary.output_tokens == 5
    assert summary.failures == {"status 503": 1, "status 429": 1, "timeout": 1}
    assert summary.missing_retry_after == 1
    assert summary.ttft.count == 2 and summary.ttft.p50_ms == pytest.approx(200.0)
    assert summary.itl.count == 3 and summary.itl.p50_ms == pytest.approx(100.0)
    assert summary.tpot.mean_ms == pytest.approx((210 / 2 + 210) / 2)  # ends 10 ms after
    assert summary.output_tok_s == pytest.approx(5 / summary.duration_s)
    assert throughput_timeline(records[:2], bin_s=0.5) == [6.0, 4.0]


def test_scripts_read_the_first_bursts_figures_back_from_the_json(tmp_path):
    records = [record(0, [0.1, 0.2, 0.3], 3), record(1, [], 0, status=503, error="busy")]
    summary = summarize("b", records)
    counted = dataclasses.replace(summary, server=ServerCounters(2, 100, 60))
    path = tmp_path / "bench_serve.json"
    write_json(path, BenchMeta(url="u"), [counted, summary], [records, records])
    figures = first_burst_figures(path)
    assert figures == {
        "completed": 1,
        "sent": 2,
        "failures": {"status 503": 1},
        "ttft_p50_s": pytest.approx(summary.ttft.p50_ms / 1000),
        "ttft_p99_s": pytest.approx(summary.ttft.p99_ms / 1000),
        "tok_s": pytest.approx(summary.output_tok_s),
        "server": {"adapter_loads": 2, "prefix_queries": 100, "prefix_hits": 60},
    }
