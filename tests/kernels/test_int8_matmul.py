"""Int8 projections (kernels/int8_matmul.py) against their plain-torch reference and the
float product they approximate."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.int8_matmul import (
    DYNAMIC_MIN_ROWS,
    VNNI_WIDE_ROWS,
    Int8Weight,
    cpu_has_vnni,
    dequantize,
    pack_vnni,
    quantize_per_channel,
    reference_int8_linear,
    smoothing_gain,
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


@pytest.mark.parametrize("rows", [8, 32])
def test_dynamic_rows_quantize_activations_per_token(weight, rows):
    """The product is int8 x int8 at any batch: a row scaled by 1000 gives its own
    result scaled by 1000 (its own activation scale), the others unchanged."""
    layer = Int8Weight.from_float(weight, "dynamic", native=True)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(3))
    scaled = x.clone()
    scaled[5] *= 1000.0
    base, big = layer(x, None), layer(scaled, None)
    torch.testing.assert_close(big[5], base[5] * 1000.0, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(big[torch.arange(rows) != 5], base[torch.arange(rows) != 5])


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 7, VNNI_WIDE_ROWS, 13, DYNAMIC_MIN_ROWS, 31, 64])
@pytest.mark.parametrize(
    "shape",
    [(100, 66), (80, 66), (64, 66), (32, 66), (48, 1536)],
    ids=["seven-blocks-ragged", "five-blocks", "four-blocks", "two-blocks", "long-k"],
)
def test_vnni_rows_kernel_equals_torch_int8_matmul(dtype, rows, shape):
    """cpu_ops.int8_linear_rows gives quantize_rows_int8 + torch._int_mm (rows padded)
    + dequantize_int32 bit for bit: ragged N and K (padding), a long K (int32 sums of
    1,536 products), with and without bias and input scales; every row tile (8, 4, 2
    and 1 rows) and every tile width (1 to 6 blocks of 16 output channels, as 7, 5, 4, 3
    and 2 blocks split by 6 below 8 rows and by 3 from 8 on)."""
    from loraplex.kernels import cpu_ops

    if not cpu_ops.load():
        pytest.skip("no native CPU kernels here")
    out_features, in_features = shape
    generator = torch.Generator().manual_seed(rows * 7 + in_features)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    quantized, scale = quantize_per_channel(weight)
    quantized[0] = -128  # the full int8 range, as a checkpoint may store it
    packed, col_sums = pack_vnni(quantized)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    x[0, :5] = 0.0
    channel = torch.rand(in_features, generator=generator) * 4
    some_bias = torch.randn(out_features, generator=generator).to(dtype)
    for input_scales, bias in ((None, None), (None, some_bias), (channel, some_bias)):
        xq, row_scale = cpu_ops.quantize_rows_int8(x, input_scales)
        padded = torch.nn.functional.pad(xq, (0, 0, 0, max(0, DYNAMIC_MIN_ROWS + 1 - rows)))
        acc = torch._int_mm(padded, quantized.t().contiguous())[:rows].contiguous()
        got = cpu_ops.int8_linear_rows(x, input_scales, packed, col_sums, scale, bias, out_features)
        want = cpu_ops.dequantize_int32(acc, row_scale, scale, bias, dtype)
        assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("rows", [1, 5, DYNAMIC_MIN_ROWS, DYNAMIC_MIN_ROWS + 1])
def test_native_dynamic_small_batches_equal_the_torch_path(weight, rows):
    """Up to DYNAMIC_MIN_ROWS rows the native dynamic product (the VNNI rows kernel where
    the CPU has it) equals the torch path, W8A8 as past it."""
    from loraplex.kernels import cpu_ops

    if not cpu_ops.load():
        pytest.skip("no native CPU kernels here")
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    bias = torch.randn(96).to(torch.bfloat16)
    native = Int8Weight.from_float(weight, "dynamic", native=True)
    plain = Int8Weight.from_float(weight, "dynamic", native=False)
    assert (native.vnni is not None) == cpu_has_vnni()
    assert torch.equal(native(x, bias), plain(x, bias))
    assert torch.equal(native.quantized, plain.quantized)


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("rows", [5, 40])
def test_an_input_gain_smooths_an_outlier_channel(weight, native, rows):
    """Activations whose channels a norm's weight scales unevenly (one channel 40x),
    into a weight whose columns that norm's scale was trained against (divided by it,
    as the norm and projection of a trained model balance): with the norm's weight as
    input gain the W8A8 product keeps the float weight (dequantized / gain), matches its
    reference (native or not, small or large batch) and is several times closer to the
    float product than without it."""
    from loraplex.kernels import cpu_ops

    if native and not cpu_ops.load():
        pytest.skip("no native CPU kernels here")
    generator = torch.Generator().manual_seed(rows)
    norm_weight = torch.rand(64, generator=generator) + 0.5
    norm_weight[9] = 40.0
    weight = weight / norm_weight
    x = torch.randn(rows, 64, generator=generator) * norm_weight
    smooth = Int8Weight.from_float(weight, "dynamic", native, input_gain=norm_weight)
    plain = Int8Weight.from_float(weight, "dynamic", native)
    gain = smoothing_gain(norm_weight)
    error = (dequantize(smooth.quantized, smooth.scale) / gain - weight).abs()
    assert (error <= smooth.scale[:, None] / gain / 2 + 1e-6).all()
    got = smooth(x, None)
    want = reference_int8_linear(
        x, smooth.quantized, smooth.scale, None, "dynamic", smooth.input_scales
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    exact = x @ weight.T
    smoothed_error = (got - exact).abs().mean()
    assert smoothed_error * 3 < (plain(x, None) - exact).abs().mean()


def test_an_input_gain_is_for_the_dynamic_mode(weight):
    with pytest.raises(ValueError, match="dynamic int8 mode only"):
        Int8Weight.from_float(weight, "weight_only", input_gain=torch.ones(64))
