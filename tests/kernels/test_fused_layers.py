"""Fused Triton RMSNorm (+ residual, + a pending LoRA expand), SiLU-and-mul (+ a pending
LoRA expand) and rotary + KV-cache write against their torch references and the
engine's torch layers, under the interpreter off CUDA.

Tolerances: fp32 1e-6 (same operations, fp32 rounding); fp16 / bf16 one ulp of values
of order 1 (the kernels keep fp32 where the torch layers round an intermediate). The
interpreter rounds fp32 -> bf16 toward zero where a GPU rounds to nearest even, and
RMSNorm rounds three times (sum, normed, product): under it bf16 allows 2.5 ulps.
"""

from __future__ import annotations

import os

import pytest
import torch

from loraplex.kernels import torch_layers
from loraplex.kernels.lora import PendingExpand
from loraplex.kernels.reference import reference_rotary_write_kv
from loraplex.kernels.rms_norm import rms_norm
from loraplex.kernels.rotary_kv import rotary_write_kv
from loraplex.kernels.silu_and_mul import silu_and_mul
from loraplex.kernels.torch_layers import apply_rotary
from loraplex.kernels.torch_paged_attention import read_slots, write_kv
from loraplex.platform.layers.norm import RMSNorm

reference_rms_norm = torch_layers.rms_norm
"""The torch path is the reference of the fused RMSNorm kernel."""
DEVICE = torch.device(os.environ.get("LORAPLEX_TEST_DEVICE", "cpu"))
"""Set by tests/conftest.py: 'cuda' on a GPU, else 'cpu' (the Triton interpreter)."""
INTERPRETED = DEVICE.type == "cpu"
TOLERANCES = {
    torch.float32: 1e-6,
    torch.float16: 1e-3,
    torch.bfloat16: 2e-2 if INTERPRETED else 8e-3,
}
DTYPES = list(TOLERANCES)


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.cpu().float(), expected.cpu().float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [1, 48, 64, 100])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_matches_reference_and_the_torch_layer(dtype, hidden, with_residual):
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(5, hidden, generator=gen) * 3).to(dtype)
    residual = torch.randn(5, hidden, generator=gen).to(dtype) if with_residual else None
    weight = torch.randn(hidden, generator=gen).to(dtype)
    out, new_residual = rms_norm(
        x.to(DEVICE), None if residual is None else residual.to(DEVICE), weight.to(DEVICE), 1e-5
    )
    expected, expected_residual = reference_rms_norm(x, residual, weight, 1e-5)
    close(out, expected, dtype)
    if dtype == torch.bfloat16 and INTERPRETED:
        close(new_residual, expected_residual, dtype)  # the interpreter truncates to bf16
    else:
        assert torch.equal(new_residual.cpu(), expected_residual)

    layer = RMSNorm(hidden, 1e-5, dtype)
    layer.weight.data.copy_(weight)
    layer_out, _ = layer(x, residual)
    close(out, layer_out, dtype)


def test_rms_norm_reads_strided_rows_and_zero_rows():
    x_wide = torch.randn(4, 40)
    x = x_wide[:, :32]
    residual = torch.randn(4, 32)
    weight = torch.rand(32)
    out, new_residual = rms_norm(
        x_wide.to(DEVICE)[:, :32], residual.to(DEVICE), weight.to(DEVICE), 1e-6
    )
    expected, expected_residual = reference_rms_norm(x, residual, weight, 1e-6)
    close(out, expected, torch.float32)
    close(new_residual, expected_residual, torch.float32)
    empty_out, _ = rms_norm(torch.zeros(0, 32, device=DEVICE), None, weight.to(DEVICE), 1e-6)
    assert empty_out.shape == (0, 32)
    zero_out, _ = rms_norm(torch.zeros(2, 32, device=DEVICE), None, weight.to(DEVICE), 1e-6)
    assert zero_out.eq(0).all()


def rotary_case(num_tokens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    """A fused qkv output (q / k / v are strided views into it), per-token cos / sin, a
    NaN cache and a slot per token (distinct, in shuffled blocks)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    qkv = qkv.to(dtype)
    angles = torch.rand(num_tokens, head_dim // 2, generator=gen) * 50
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    num_blocks = -(-num_tokens // block_size) + 2
    cache = torch.full((2, num_blocks, num_kv_heads, block_size, head_dim), float("nan"))
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    return qkv, cos, sin, cache.to(dtype), slots


def split_qkv(qkv, num_heads, num_kv_heads, head_dim):
    q, k, v = qkv.split(
        (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim), dim=-1
    )
    t = qkv.shape[0]
    return (
        q.view(t, num_heads, head_dim),
        k.view(t, num_kv_heads, head_dim),
        v.view(t, num_kv_heads, head_dim),
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "num_tokens,num_heads,num_kv_heads,head_dim,block_size",
    [(1, 4, 2, 16, 16), (9, 6, 2, 24, 4), (17, 3, 3, 32, 8), (5, 8, 1, 10, 1)],
)
def test_rotary_write_kv_matches_reference_and_the_torch_layers(
    dtype, num_tokens, num_heads, num_kv_heads, head_dim, block_size
):
    heads = (num_heads, num_kv_heads, head_dim)
    qkv, cos, sin, cache, slots = rotary_case(num_tokens, *heads, block_size, dtype)
    ref_qkv, ref_cache = qkv.clone(), cache.clone()
    torch_qkv, torch_cache = qkv.clone(), cache.clone()
    ref_q, ref_k = reference_rotary_write_kv(
        *split_qkv(ref_qkv, *heads), cos, sin, ref_cache, slots
    )

    qkv_dev, cache_dev = qkv.to(DEVICE, copy=True), cache.to(DEVICE, copy=True)
    q, k, v = split_qkv(qkv_dev, *heads)
    rotary_write_kv(q, k, v, cos.to(DEVICE), sin.to(DEVICE), cache_dev, slots.to(DEVICE))
    close(q, ref_q, dtype)
    close(k, ref_k, dtype)
    written = read_slots(cache_dev.cpu(), slots)
    close(written, read_slots(ref_cache, slots), dtype)
    untouched = torch.ones(cache.shape[1] * block_size, dtype=torch.bool)
    untouched[slots] = False
    all_slots = torch.arange(cache.shape[1] * block_size)
    assert read_slots(cache_dev.cpu(), all_slots[untouched]).isnan().all()

    # The engine's torch layers: apply_rotary (products rounded to the dtype) + write_kv.
    torch_q, torch_k, torch_v = split_qkv(torch_qkv, *heads)
    torch_q = apply_rotary(torch_q, cos[:, None], sin[:, None])
    torch_k = apply_rotary(torch_k, cos[:, None], sin[:, None])
    write_kv(torch_cache, torch_k, torch_v, slots)
    close(q, torch_q, dtype)
    close(written, read_slots(torch_cache, slots), dtype)


def test_negative_slots_skip_the_cache_write():
    heads = (2, 1, 8)
    qkv, cos, sin, cache, slots = rotary_case(3, *heads, 4, torch.float32)
    slots[1] = -1
    qkv, cos, sin, cache, slots = (t.to(DEVICE) for t in (qkv, cos, sin, cache, slots))
    q, k, v = split_qkv(qkv, *heads)
    rotary_write_kv(q, k, v, cos, sin, cache, slots)
    assert read_slots(cache, slots[[0, 2]]).isfinite().all()
    assert int(cache.isfinite().all(-1).all(2).sum()) == 2 * 2  # K and V of two tokens


def test_bad_shapes_are_refused():
    heads = (2, 1, 8)
    qkv, cos, sin, cache, slots = rotary_case(3, *heads, 4, torch.float32)
    q, k, v = split_qkv(qkv, *heads)
    with pytest.raises(ValueError, match="cos / sin"):
        rotary_write_kv(q, k, v, cos[:2], sin[:2], cache, slots)
    with pytest.raises(ValueError, match="kv_cache"):
        rotary_write_kv(q, k, v, cos, sin, cache[:, :, :, :, :4], slots)
    with pytest.raises(ValueError, match="hidden"):
        rms_norm(torch.zeros(3), None, torch.ones(3), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [48, 100, 300, 2100])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("one_pass", [None, False], ids=["auto", "two_pass"])
def test_rms_norm_expand_equals_the_expand_then_the_norm(dtype, hidden, with_residual, one_pass):
    """The norm with a projection's pending LoRA expand (a folded shrink) against the
    torch expand (`PendingExpand.apply`) then the reference norm: tokens on three slots
    and the base model, x rows strided as a folded matmul's output; rows in one tile,
    and past it (2100: a B tile of 4096 x 16 takes the two-pass form over chunks; forced
    for the others, 300 in two chunks)."""
    gen = torch.Generator().manual_seed(hidden + 7)
    slots, rank, tokens = 3, 16, 9
    folded = (torch.randn(tokens, hidden + slots * rank, generator=gen) * 3).to(dtype)
    x = folded[:, :hidden]
    shrunk = folded[:, hidden:].view(tokens, slots, rank)
    lora_b = (torch.randn(slots, hidden, rank, generator=gen) / 4).to(dtype)
    token_slots = torch.tensor([0, 0, -1, 2, 2, 2, 1, -1, 0])
    residual = torch.randn(tokens, hidden, generator=gen).to(dtype) if with_residual else None
    weight = torch.randn(hidden, generator=gen).to(dtype)
    pending = PendingExpand(shrunk.to(DEVICE), lora_b.to(DEVICE), token_slots.to(DEVICE))
    out, new_residual = rms_norm(
        folded.to(DEVICE)[:, :hidden],
        None if residual is None else residual.to(DEVICE),
        weight.to(DEVICE),
        1e-5,
        pending,
        one_pass=one_pass,
    )
    expanded = PendingExpand(shrunk, lora_b, token_slots).apply(x)
    assert not torch.equal(expanded, x), "the adapters moved the rows"
    expected, expected_residual = reference_rms_norm(expanded, residual, weight, 1e-5)
    close(out, expected, dtype)
    close(new_residual, expected_residual, dtype)
    base_rows = token_slots < 0
    if residual is None and not (dtype == torch.bfloat16 and INTERPRETED):
        assert torch.equal(new_residual.cpu()[base_rows], x[base_rows]), "no delta: x itself"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("half", [8, 100, 300])
@pytest.mark.parametrize("with_lora", [False, True])
def test_silu_and_mul_matches_the_torch_path(dtype, half, with_lora):
    """The SiLU-and-mul kernel against the torch path, alone and with gate_up's pending
    LoRA expand (two slices, block-diagonal B): tokens on two slots and the base model,
    x rows strided as a folded matmul's output, columns past one chunk at rank 2 x 16."""
    gen = torch.Generator().manual_seed(half + 11)
    slots, rank, tokens = 2, 32, 7
    folded = (torch.randn(tokens, 2 * half + slots * rank, generator=gen) * 2).to(dtype)
    x = folded[:, : 2 * half]
    expected_input = x
    pending = None
    if with_lora:
        lora_b = torch.zeros(slots, 2 * half, rank)
        lora_b[:, :half, :16] = torch.randn(slots, half, 16, generator=gen) / 4
        lora_b[:, half:, 16:] = torch.randn(slots, half, 16, generator=gen) / 4
        shrunk = folded[:, 2 * half :].view(tokens, slots, rank)
        slots_of = torch.tensor([1, 1, -1, 0, 0, -1, 1])
        pending = PendingExpand(shrunk, lora_b.to(dtype), slots_of)
        expected_input = pending.apply(x)
        assert not torch.equal(expected_input, x)
    on_device = folded.to(DEVICE)[:, : 2 * half]
    if pending is not None:
        pending = PendingExpand(
            pending.shrunk.to(DEVICE), pending.b.to(DEVICE), pending.token_slots.to(DEVICE)
        )
    out = silu_and_mul(on_device, pending)
    expected = torch_layers.silu_and_mul(expected_input)
    if with_lora and dtype == torch.bfloat16:
        # The delta, summed in another order than the reference's, can round gate + delta
        # or up + delta one ulp apart, which silu and the product carry: 2 ulps on a GPU,
        # 4 under the interpreter (it truncates each of the four roundings).
        tol = 4e-2 if INTERPRETED else 2e-2
        torch.testing.assert_close(out.cpu().float(), expected.float(), atol=tol, rtol=tol)
    else:
        close(out, expected, dtype)


def test_silu_and_mul_refuses_an_expand_that_does_not_fit():
    x = torch.randn(3, 20, device=DEVICE)
    slots = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    pending = PendingExpand(
        torch.zeros(3, 2, 4, device=DEVICE), torch.zeros(2, 10, 4, device=DEVICE), slots
    )
    with pytest.raises(ValueError, match="does not fit"):
        silu_and_mul(x, pending)
