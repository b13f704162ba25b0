"""The kernel microbenchmarks: each one's code runs once on tiny shapes on
LORAPLEX_TEST_DEVICE (tests/conftest.py: compiled on a GPU, else under the Triton
interpreter; timing swapped for a single call), the table's arithmetic, and the no-GPU
exit. Real figures need a GPU (kernels/README.md)."""

from __future__ import annotations

import os

import pytest
import torch

from loraplex.tools.engine_bench import kernels as bench

TINY = [
    "--dtype=fp32",
    "--lora-in=32",
    "--lora-out=48",
    "--lora-rank=8",
    "--lora-slots=3",
    "--decode-tokens=5",
    "--segments=2",
    "--segment-len=7",
    "--heads=4",
    "--kv-heads=2",
    "--head-dim=16",
    "--block-size=4",
    "--batch=3",
    "--context=9",
    "--chunks=2",
    "--chunk-len=5",
    "--prefix-len=6",
    "--tokens=6",
    "--hidden=24",
]


@pytest.mark.parametrize("name", sorted(bench.BENCHMARKS))
def test_each_benchmark_runs_on_tiny_shapes(name, monkeypatch):
    calls = []

    def run_once(fn):
        fn()
        calls.append(fn)
        return 1.0

    device = torch.device(os.environ.get("LORAPLEX_TEST_DEVICE", "cpu"))
    monkeypatch.setattr(bench, "bench_device", lambda: device)
    monkeypatch.setattr(bench, "time_ms", run_once)
    args = bench.build_parser().parse_args(TINY)
    results = bench.BENCHMARKS[name].run(args)
    assert len(results) == len(calls) >= 2
    assert all(m.bytes > 0 and m.flops > 0 for m in results)


def test_registry_lists_every_kernel_family():
    assert {"lora", "attention", "rms_norm", "rotary"} <= set(bench.BENCHMARKS)


def test_table_reports_bandwidth_and_fraction_of_peak():
    peak = bench.device_peak("NVIDIA H100 80GB HBM3")
    assert peak is not None and peak.bytes_per_s == 3.35e12
    row = bench.Measurement("decode triton", "D=64", ms=1.0, bytes=2 * 10**9, flops=10**9)
    table = bench.format_table([row], peak).splitlines()
    assert table[1].split()[-4:] == ["2000", "1.00", "59.7", "0.10"]
    assert bench.device_peak("Some Other GPU") is None


def test_without_cuda_the_command_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert bench.main([]) == 0
    assert "need CUDA" in capsys.readouterr().out
