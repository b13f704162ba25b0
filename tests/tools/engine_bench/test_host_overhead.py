"""tools/engine_bench/host_overhead.py: a step's time splits into operator time and host time, both
positive, over exactly the engine's steps; nested operators are counted once."""

from __future__ import annotations

import time

import torch

from loraplex.tools.engine_bench.host_overhead import (
    NATIVE_STACK,
    PYTHON_LOOP,
    format_host_report,
    operator_seconds,
    run_host_bench,
)


def test_host_bench_on_a_tiny_model(tiny_model_factory):
    report = run_host_bench(
        model=str(tiny_model_factory("llama")),
        dtype="float32",
        batches=(1, 4),
        prompt_len=8,
        output_len=5,
        rounds=1,
        engine_options={"max_model_len": 64},
    )
    assert [(row.batch, row.path) for row in report.rows] == [
        (1, NATIVE_STACK),
        (1, PYTHON_LOOP),
        (4, NATIVE_STACK),
        (4, PYTHON_LOOP),
    ]
    for row in report.rows:
        assert row.steps == 5, "one prefill step, then a decode step per further token"
        assert row.kernel_us > 0 and row.host_us > 0
        assert row.host_us_per_layer == row.host_us / row.num_layers
    text = format_host_report(report)
    assert "| 4 | python loop | 5 |" in text
    assert "batch 4: host" in text


def test_operator_seconds_counts_python_calls_not_nested_ones():
    """The run's operators take most of its time outside the sleep, so counting a
    nested operator again would push the total past that time."""
    a = torch.randn(512, 512)
    wall = []

    def run() -> int:
        started = time.perf_counter()
        for _ in range(20):
            torch.nn.functional.linear(a, a)  # aten::linear calls aten::matmul inside
        time.sleep(0.1)  # host time: not inside an operator
        wall.append(time.perf_counter() - started)
        return 1

    steps, profiled_wall, seconds = operator_seconds(run)
    assert steps == 1
    assert profiled_wall >= wall[0]
    assert 0 < seconds < wall[0] - 0.1
