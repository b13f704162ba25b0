"""Int8 projections (kernels/int8_matmul.py) against their plain-torch reference and the
float product they approximate."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.int8_matmul import (
    DYNAMIC_MIN_ROWS,
    Int8Weight,
    dequantize,
    quantize_per_channel,
    reference_int8_linear,
)


@pytest.fixture
def weight() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=generator) * 0.05
    weight[7] = 0.0  # an all-zero channel keeps scale 1
    return weight


def test_per_channel_quantization(weight):
    quantized, scale = quantize_per_channel(weight)
    assert quantized.dtype == torch.int8 and scale.shape == (96,)
    assert int(quantized.abs().max()) == 127 and scale[7] == 1.0
    assert quantized.abs().amax(dim=1)[torch.arange(96) != 7].eq(127).all()
    error = (dequantize(quantized, scale) - weight).abs()
    assert (error <= scale[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("mode", ["weight_only", "dynamic"])
@pytest.mark.parametrize("rows", [1, DYNAMIC_MIN_ROWS, DYNAMIC_MIN_ROWS + 1, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_weight_matches_its_reference(weight, mode, rows, dtype):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=generator).to(dtype)
    bias = torch.randn(96, generator=generator).to(dtype)
    layer = Int8Weight.from_float(weight, mode)
    got = layer(x, bias)
    want = reference_int8_linear(x, layer.quantized, layer.scale, bias, mode)
    assert got.dtype == dtype and got.shape == (rows, 96)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    exact = x.float() @ weight.T + bias.float()
    assert (got.float() - exact).abs().max() < 0.05 * exact.abs().max()


def test_dynamic_rows_quantize_activations_per_token(weight):
    """Past DYNAMIC_MIN_ROWS rows the product is int8 x int8: a row scaled by 1000 gives
    its own result scaled by 1000 (its own activation scale), the others unchanged."""
    layer = Int8Weight.from_float(weight, "dynamic")
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    scaled = x.clone()
    scaled[5] *= 1000.0
    base, big = layer(x, None), layer(scaled, None)
    torch.testing.assert_close(big[5], base[5] * 1000.0, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(big[torch.arange(32) != 5], base[torch.arange(32) != 5])


def test_unknown_mode_is_refused(weight):
    with pytest.raises(ValueError, match="int8 mode"):
        Int8Weight.from_float(weight, "int4")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_native_dynamic_path_equals_the_torch_path(weight, dtype, with_bias):
    """The native quantize / rescale ops give the torch path's result bit for bit."""
    from loraplex.kernels import cpu_ops

    if not cpu_ops.load():
        pytest.skip("no native CPU kernels here")
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(5)).to(dtype)
    x[3] = 0.0
    bias = torch.randn(96).to(dtype) if with_bias else None
    native = Int8Weight.from_float(weight, "dynamic", native=True)(x, bias)
    plain = Int8Weight.from_float(weight, "dynamic", native=False)(x, bias)
    assert native.dtype == dtype
    assert torch.equal(native, plain)
