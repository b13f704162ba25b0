"""Int4 weight-only projections (kernels/int4_matmul.py) against their plain-torch
reference: compressed-tensors' packing, round-to-nearest quantizing, the native
dequantizing and both products (torch's int4 kernel and dequantize + float matmul)."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.int4_matmul import (
    INT4_GEMV_ROWS,
    Int4Weight,
    dequantize_int4,
    pack_int4,
    quantize_int4,
    reference_int4_linear,
    unpack_int4,
)


def test_packing_is_compressed_tensors_layout():
    """Eight values per int32, the first in the lowest 4 bits, each stored + 8; a
    ragged last word is padded."""
    q = torch.tensor([[-8, -7, -6, -5, -4, -3, -2, -1, 7, 0]], dtype=torch.int8)
    packed = pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (1, 2)
    assert int(packed[0, 0]) & 0xFFFFFFFF == 0x76543210
    assert int(packed[0, 1]) & 0xFF == 0x8F
    assert torch.equal(unpack_int4(packed, 10), q)
    values = torch.randint(-8, 8, (5, 37), dtype=torch.int8)
    assert torch.equal(unpack_int4(pack_int4(values), 37), values)
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_int4(torch.tensor([[8]], dtype=torch.int8))


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [32, 48, None], ids=["g32", "g48-ragged", "channel"])
def test_round_to_nearest_stays_within_half_a_step(symmetric, group_size):
    weight = torch.randn(24, 80, generator=torch.Generator().manual_seed(1)) * 0.1
    weight[3] = 0.0
    q, scale, zero = quantize_int4(weight, group_size, symmetric)
    size = group_size or 80
    assert q.dtype == torch.int8 and int(q.min()) >= -8 and int(q.max()) <= 7
    assert scale.shape == (24, -(-80 // size)) and (zero is None) == symmetric
    error = (dequantize_int4(q, scale, zero, size) - weight).abs()
    steps = scale.float()[:, torch.arange(80) // size]
    assert (error <= steps / 2 + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("symmetric", [True, False])
def test_native_dequantizing_equals_the_torch_statement(dtype, symmetric):
    from loraplex.kernels import cpu_ops

    if not cpu_ops.load():
        pytest.skip("no native CPU kernels here")
    weight = torch.randn(40, 70, generator=torch.Generator().manual_seed(2))
    q, scale, zero = quantize_int4(weight, 32, symmetric)
    got = cpu_ops.dequantize_int4(pack_int4(q), scale.float(), zero, 32, 70, dtype)
    want = dequantize_int4(q, scale, zero, 32).to(dtype)
    assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, INT4_GEMV_ROWS, INT4_GEMV_ROWS + 1, 64])
@pytest.mark.parametrize(
    ("shape", "group_size", "symmetric"),
    [
        ((96, 64), 32, True),
        ((100, 80), 32, False),
        ((96, 64), 48, True),
        ((48, 96), None, False),
    ],
    ids=["g32", "g32-ragged-asymmetric", "g48-no-torch-kernel", "channel-asymmetric"],
)
@pytest.mark.parametrize("native", [True, False])
def test_int4_weight_matches_its_reference(dtype, rows, shape, group_size, symmetric, native):
    """Both products (torch's int4 kernel up to INT4_GEMV_ROWS rows where it takes the
    group size; dequantize + float matmul past it or where it does not) give the
    reference's answer within the dtype's rounding: ragged output channels and inputs
    (padded for torch's kernel), asymmetric zeros, one group per channel."""
    out_features, in_features = shape
    generator = torch.Generator().manual_seed(rows + in_features)
    weight = torch.randn(shape, generator=generator) * 0.05
    q, scale, zero = quantize_int4(weight, group_size, symmetric)
    size = group_size or in_features
    layer = Int4Weight(q, scale, zero, size, dtype, native=native)
    assert (layer.gemv is not None) == (size % 32 == 0)
    assert torch.equal(layer.quantized, q)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype)
    got = layer(x, bias)
    want = reference_int4_linear(x, q, scale, zero, size, bias)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance)
    exact = x.float() @ weight.T + bias.float()
    assert (got.float() - exact).abs().max() < 0.15 * exact.abs().max()


def test_shapes_are_checked():
    q = torch.zeros(16, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match="scale must be"):
        Int4Weight(q, torch.ones(16, 1), None, 32, torch.float32)
    with pytest.raises(ValueError, match="zero must be"):
        Int4Weight(q, torch.ones(16, 2), torch.zeros(16, 1, dtype=torch.int8), 32, torch.float32)
