"""A projection whose LoRA shrink is folded into its weight (platform/layers/linear.py
`fold_lora_shrink`, on the Triton backend): its weight and its slots' A are views of one
tensor, one matmul gives the base output and every slot's shrink, and the output equals
the plain torch reference (x @ W.T plus each token's PEFT-style delta) for steps of
adapter segments, while decode steps (BGMV) and unfolded projections take the unfolded
path. Off CUDA the Triton kernels run under the interpreter (tests/conftest.py).

Tolerance: fp32, rtol = atol = 1e-4 (every path accumulates in fp32).
"""

from __future__ import annotations

import os

import pytest
import torch

from loraplex.kernels.backends import get_backend
from loraplex.kernels.lora import LoRABatch
from loraplex.platform.layers.linear import MergedLinear
from loraplex.platform.sleep_mode import move_tensors

DEVICE = torch.device(os.environ.get("LORAPLEX_TEST_DEVICE", "cpu"))
SLICES = (40, 16, 16)
IN_FEATURES = 48
SLOTS, RANK = 4, 8
SLOT_RANKS = (8, 4, 0, 8)
"""Real rank per slot (slot 2 stays empty): columns past it are zero."""


def make_projection(kernels: str = "triton", seed: int = 0) -> MergedLinear:
    """A fused projection with random weights and random adapters in its slots."""
    gen = torch.Generator().manual_seed(seed)
    layer = MergedLinear(IN_FEATURES, SLICES, bias=False, dtype=torch.float32, device=DEVICE)
    layer.weight.data.copy_(torch.randn(layer.weight.shape, generator=gen))
    layer.enable_lora(SLOTS, RANK, get_backend(kernels))
    stack = layer.lora
    for slot, rank in enumerate(SLOT_RANKS):
        for index, (start, size) in enumerate(zip(layer.offsets, layer.output_sizes, strict=True)):
            cols = slice(index * RANK, index * RANK + rank)
            a = torch.randn(rank, IN_FEATURES, generator=gen) / 4
            b = torch.randn(size, rank, generator=gen) / 4
            stack.a[slot, cols].copy_(a)
            stack.b[slot, start : start + size, cols].copy_(b)
    return layer


def reference(layer: MergedLinear, x: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """x @ W.T, plus x[t] @ A[s].T @ B[s].T for each token t with a slot s >= 0 (fp64,
    on the CPU)."""
    out = x.double() @ layer.weight.detach().cpu().double().T
    a, b = layer.lora.a.cpu().double(), layer.lora.b.cpu().double()
    for t, slot in enumerate(slots):
        if slot >= 0:
            out[t] += (x[t].double() @ a[slot].T) @ b[slot].T
    return out


def prefill_batch(slots: list[int]) -> LoRABatch:
    return LoRABatch.from_token_slots(slots, 0, DEVICE, SLOT_RANKS)


PREFILL_SLOTS = [0] * 5 + [-1] * 3 + [1] * 7 + [3] * 2 + [2] * 1 + [0] * 4
"""Prefill chunks of four adapters (one in an empty slot) and the base model."""


def test_the_weight_and_the_slots_are_views_of_one_folded_tensor():
    layer = make_projection()
    fold = layer.lora_fold
    rows = layer.out_features
    assert fold is not None and fold.shape == (rows + SLOTS * 3 * RANK, IN_FEATURES)
    assert layer.weight.data_ptr() == fold.data_ptr()
    assert layer.lora.a.data_ptr() == fold[rows:].data_ptr()
    torch.testing.assert_close(fold[rows:].view_as(layer.lora.a), layer.lora.a, rtol=0, atol=0)


def test_a_step_of_segments_runs_one_folded_matmul_and_equals_the_reference():
    layer = make_projection()
    x = torch.randn(len(PREFILL_SLOTS), IN_FEATURES, device=DEVICE)
    out = layer(x, prefill_batch(PREFILL_SLOTS))
    assert out.stride(0) == layer.lora_fold.shape[0], "the folded matmul's own output rows"
    expected = reference(layer, x.cpu(), PREFILL_SLOTS)
    torch.testing.assert_close(out.cpu().double(), expected, rtol=1e-4, atol=1e-4)


def test_folded_and_unfolded_paths_agree_and_the_fold_comes_back():
    layer = make_projection()
    x = torch.randn(len(PREFILL_SLOTS), IN_FEATURES, device=DEVICE)
    folded = layer(x, prefill_batch(PREFILL_SLOTS)).clone()
    layer.unfold_lora_shrink()
    assert layer.lora_fold is None
    assert layer.lora.a.data_ptr() != layer.weight.data_ptr() + layer.weight.nbytes
    unfolded = layer(x, prefill_batch(PREFILL_SLOTS))
    assert unfolded.is_contiguous(), "the weight's rows alone, then the LoRA kernels"
    torch.testing.assert_close(unfolded, folded, rtol=1e-4, atol=1e-4)
    assert layer.fold_lora_shrink()
    again = layer(x, prefill_batch(PREFILL_SLOTS))
    torch.testing.assert_close(again, folded, rtol=0, atol=0)


def test_decode_tokens_keep_their_bgmv_kernels():
    layer = make_projection()
    slots = [0, 1, 3, -1]
    x = torch.randn(len(slots), IN_FEATURES, device=DEVICE)
    out = layer(x, LoRABatch.from_token_slots(slots, len(slots), DEVICE, SLOT_RANKS))
    assert out.is_contiguous()
    torch.testing.assert_close(
        out.cpu().double(), reference(layer, x.cpu(), slots), rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
def test_the_cpu_backends_fold_nothing(kernels):
    if DEVICE.type != "cpu":
        pytest.skip("CPU backends")
    layer = make_projection(kernels)
    assert layer.lora_fold is None
    assert not layer.fold_lora_shrink()


def test_a_projection_with_a_bias_is_not_folded():
    layer = MergedLinear(IN_FEATURES, SLICES, bias=True, dtype=torch.float32, device=DEVICE)
    layer.enable_lora(SLOTS, RANK, get_backend("triton"))
    assert layer.lora_fold is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_moving_the_weight_to_the_host_unfolds_and_back_folds_again():
    layer = make_projection()
    x = torch.randn(len(PREFILL_SLOTS), IN_FEATURES, device=DEVICE)
    before = layer(x, prefill_batch(PREFILL_SLOTS)).clone()
    move_tensors([layer], torch.device("cpu"))
    assert layer.lora_fold is None and layer.weight.device.type == "cpu"
    assert layer.lora.a.device.type == DEVICE.type, "the slots stay on the device"
    move_tensors([layer], DEVICE)
    assert layer.lora_fold is not None and layer.weight.data_ptr() == layer.lora_fold.data_ptr()
    torch.testing.assert_close(layer(x, prefill_batch(PREFILL_SLOTS)), before, rtol=0, atol=0)


def test_the_torch_backend_expands_a_folded_shrink_as_the_triton_kernel_does():
    layer = make_projection()
    x = torch.randn(len(PREFILL_SLOTS), IN_FEATURES, device=DEVICE)
    batch = prefill_batch(PREFILL_SLOTS)
    base, shrunk = layer._folded_matmul(x)
    by_torch = base.clone()
    get_backend("torch").expand_folded(by_torch, shrunk, layer.lora, batch)
    by_kernel = base.clone()
    get_backend("triton").expand_folded(by_kernel, shrunk, layer.lora, batch)
    assert not torch.equal(by_torch, base)
    torch.testing.assert_close(by_torch, by_kernel, rtol=1e-4, atol=1e-4)
