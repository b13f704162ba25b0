"""The GEMM probe: the model's projections, timing every (projection, rows), the cache."""

from __future__ import annotations

import json

import pytest
import torch

from loraplex.kernels.cache_dir import CACHE_DIR_ENV
from loraplex.platform.arch import ModelArch
from loraplex.tools.engine_bench import gemm_probe
from loraplex.tools.engine_bench.gemm_probe import (
    Projection,
    QuantizedProduct,
    model_projections,
    probe_gemm_times,
)

TINY_PROJECTIONS = (
    Projection("qkv", 24, 16, 2),
    Projection("o", 16, 16, 2),
    Projection("lm_head", 40, 16, 1),
)
ROWS = {"qkv": (1, 8, 300), "o": (1, 8), "lm_head": (1,)}


@pytest.fixture
def quick_probe(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(gemm_probe, "MIN_TIMED_S", 0.001)
    return tmp_path


def test_projections_follow_the_engine_fusion(tiny_model_factory):
    arch = ModelArch.from_folder(tiny_model_factory("llama"))
    by_name = {p.name: p for p in model_projections(arch)}
    assert set(by_name) == {"qkv", "o", "gate_up", "down", "lm_head"}
    qkv_out = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
    assert (by_name["qkv"].out_features, by_name["qkv"].in_features) == (qkv_out, arch.hidden_size)
    assert by_name["gate_up"].out_features == 2 * arch.intermediate_size
    assert (by_name["down"].out_features, by_name["down"].in_features) == (
        arch.hidden_size,
        arch.intermediate_size,
    )
    assert by_name["lm_head"].out_features == arch.vocab_size
    assert by_name["lm_head"].count == 1 and not by_name["lm_head"].per_layer
    assert all(by_name[n].count == arch.num_layers for n in ("qkv", "o", "gate_up", "down"))


def test_probe_times_every_projection_at_every_row_count(quick_probe):
    times = probe_gemm_times(TINY_PROJECTIONS, ROWS, torch.float32)
    assert times.dtype == "float32" and times.num_threads == torch.get_num_threads()
    for name, rows in ROWS.items():
        for m in rows:
            assert 0 < times.time(name, m) < 0.1
            assert times.backend[name][m] in ("mkl", "onednn")


@pytest.mark.parametrize("mode", ["dynamic", "weight_only"])
def test_an_int8_probe_times_the_layers_in_int8_and_the_lm_head_as_is(quick_probe, mode):
    """The decoder layers take the int8 product of the mode at every row count; the LM
    head stays a float matmul; the probe is cached apart from fp32's."""
    product = QuantizedProduct(mode)
    times = probe_gemm_times(TINY_PROJECTIONS, ROWS, torch.float32, quantization=product)
    assert times.dtype == f"int8_{mode}/float32"
    for name, rows in ROWS.items():
        for m in rows:
            assert 0 < times.time(name, m) < 0.1
            expected = ("mkl", "onednn") if name == "lm_head" else (gemm_probe.INT8_BACKEND,)
            assert times.backend[name][m] in expected
    probe_gemm_times(TINY_PROJECTIONS, ROWS, torch.float32)
    cached = sorted(
        json.loads(f.read_text())["dtype"] for f in (quick_probe / "gemm_probe").glob("*.json")
    )
    assert cached == ["float32", f"int8_{mode}/float32"]


def test_an_int8_probe_with_the_lm_head_in_int8_times_it_in_int8(quick_probe):
    """`quantize_lm_head`'s product: the LM head takes the int8 product too, and the probe
    is cached apart from the one with a float head."""
    with_head = QuantizedProduct("dynamic", lm_head=True)
    times = probe_gemm_times(TINY_PROJECTIONS, ROWS, torch.float32, quantization=with_head)
    assert times.dtype == "int8_dynamic+lm_head/float32"
    assert set(times.backend["lm_head"].values()) == {gemm_probe.INT8_BACKEND}
    probe_gemm_times(
        TINY_PROJECTIONS, ROWS, torch.float32, quantization=QuantizedProduct("dynamic")
    )
    cached = sorted(
        json.loads(f.read_text())["dtype"] for f in (quick_probe / "gemm_probe").glob("*.json")
    )
    assert cached == ["int8_dynamic+lm_head/float32", "int8_dynamic/float32"]


def test_probe_is_cached_per_dtype_and_read_back(quick_probe, monkeypatch):
    first = probe_gemm_times(TINY_PROJECTIONS, ROWS, torch.float32)
    files = list((quick_probe / "gemm_probe").glob("*.json"))
    assert len(files) == 1
    assert json.loads(files[0].read_text())["dtype"] == "float32"

    def no_timing(*args):
        raise AssertionError("a cached probe must not time anything")

    monkeypatch.setattr(gemm_probe, "_time_streamed", no_timing)
    monkeypatch.setattr(gemm_probe, "_time_compute_bound", no_timing)
    assert probe_gemm_times(TINY_PROJECTIONS, ROWS, torch.float32) == first
    with pytest.raises(AssertionError, match="cached probe"):
        probe_gemm_times(TINY_PROJECTIONS, ROWS, torch.float32, use_cache=False)
    with pytest.raises(AssertionError, match="cached probe"):
        probe_gemm_times(TINY_PROJECTIONS, {**ROWS, "o": (1, 8, 9)}, torch.float32)
    with pytest.raises(AssertionError, match="cached probe"):
        probe_gemm_times(TINY_PROJECTIONS, {**ROWS, "qkv": (1, 8, 301)}, torch.float32)


def test_an_unreadable_cache_file_is_probed_again(quick_probe):
    probe_gemm_times(TINY_PROJECTIONS, ROWS, torch.float32)
    (cached,) = (quick_probe / "gemm_probe").glob("*.json")
    cached.write_text("{not json")
    again = probe_gemm_times(TINY_PROJECTIONS, ROWS, torch.float32)
    assert again.time("o", 8) > 0
    assert json.loads(cached.read_text())["dtype"] == "float32"


def test_the_streamed_chain_holds_every_layer_up_to_its_byte_cap():
    small = (Projection("gate_up", 3072, 576, 30), Projection("lm_head", 49152, 576, 1))
    assert gemm_probe.chain_layers(small, torch.float32) == 30
    huge = (Projection("gate_up", 28672, 8192, 80), Projection("down", 8192, 14336, 80))
    layer_bytes = (28672 * 8192 + 8192 * 14336) * 4
    assert gemm_probe.chain_layers(huge, torch.float32) == max(
        1, gemm_probe.MAX_CHAIN_BYTES // layer_bytes
    )
    assert gemm_probe.chain_layers(huge, torch.float32) < 80


@pytest.mark.parametrize("lm_head", [False, True])
def test_an_int4_probe_times_the_layers_in_int4(quick_probe, lm_head):
    """An int4 checkpoint's product: the layers int4 in groups (here of 32), the LM head
    float, or W8A8 with `quantize_lm_head`; named by its groups."""
    product = QuantizedProduct(gemm_probe.INT4, lm_head=lm_head, group_size=32)
    times = probe_gemm_times(TINY_PROJECTIONS, ROWS, torch.float32, quantization=product)
    assert times.dtype == "int4_g32" + ("+lm_head" if lm_head else "") + "/float32"
    head = {gemm_probe.INT8_BACKEND} if lm_head else {"mkl", "onednn"}
    for name, rows in ROWS.items():
        for m in rows:
            assert 0 < times.time(name, m) < 0.1
            backends = head if name == "lm_head" else {gemm_probe.INT4_BACKEND}
            assert times.backend[name][m] in backends
