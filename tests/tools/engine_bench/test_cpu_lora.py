"""tools/engine_bench/cpu_lora.py: the slot stacks are packed as the engine packs a fused
projection, the cases put tokens where their names say, and a tiny run reports every case
with both paths timed."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels import cpu_ops
from loraplex.kernels.lora import LoRABatch, cpu_add_lora, torch_add_lora
from loraplex.tools.engine_bench.cpu_lora import (
    CASES,
    ModelShape,
    build_parser,
    case_slots,
    main,
    slot_stacks,
)

TINY = ModelShape(layers=2, hidden=32, intermediate=48, q_size=32, kv_size=16)
TINY_ARGS = [
    "--layers=2",
    "--hidden=32",
    "--intermediate=48",
    "--q-size=32",
    "--kv-size=16",
    "--slots=3",
    "--rank=4",
    "--decode-tokens=6",
    "--prefill-runs=4",
    "--prefill-len=5",
    "--rounds=1",
    "--repeats=1",
]


@pytest.mark.skipif(not cpu_ops.load(), reason="the native CPU ops do not build here")
def test_slot_stacks_are_block_diagonal_by_slice():
    stacks = slot_stacks(TINY, slots=3, rank=4, dtype=torch.bfloat16)
    assert len(stacks) == 4 * TINY.layers
    qkv = stacks[0]
    assert qkv.slice_ends == (32, 48, 64)
    assert qkv.a.shape == (3, 12, 32) and qkv.b.shape == (3, 64, 12)
    assert qkv.a.dtype == qkv.b.dtype == torch.float32, "fp32 slots for a bf16 model"
    assert qkv.b.stride(1) == 1, "rank-major, as the native kernel reads B"
    for index, (start, end) in enumerate([(0, 32), (32, 48), (48, 64)]):
        own = slice(index * 4, (index + 1) * 4)
        block = qkv.b[:, start:end]
        assert torch.count_nonzero(block[:, :, own]) == block[:, :, own].numel()
        assert torch.count_nonzero(block) == block[:, :, own].numel(), "zero off its block"


def test_cases_put_tokens_where_their_names_say():
    args = build_parser().parse_args(TINY_ARGS)
    decode, decodes = case_slots("decode", args)
    assert decode == [0, 0, 1, 1, 2, 2] and decodes == 6
    one, _ = case_slots("decode, one", args)
    assert one == [0] * 6
    prefill, decodes = case_slots("prefill", args)
    assert decodes == 0 and prefill == [0] * 5 + [1] * 5 + [2] * 5 + [0] * 5


@pytest.mark.skipif(not cpu_ops.load(), reason="the native CPU ops do not build here")
def test_both_paths_the_bench_times_add_the_same_delta():
    args = build_parser().parse_args(TINY_ARGS)
    stack = slot_stacks(TINY, slots=3, rank=4, dtype=torch.float32)[2]
    slots, decodes = case_slots("prefill", args)
    batch = LoRABatch.from_token_slots(slots, decodes, torch.device("cpu"), slot_ranks=[4] * 3)
    x = torch.randn(len(slots), stack.a.size(2))
    native = torch.zeros(len(slots), stack.slice_ends[-1])
    reference = native.clone()
    cpu_add_lora(native, x, stack.a, stack.b, batch, stack.slice_ends)
    torch_add_lora(reference, x, stack.a, stack.b, batch, len(stack.slice_ends))
    assert torch.count_nonzero(native) > 0
    torch.testing.assert_close(native, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not cpu_ops.load(), reason="the native CPU ops do not build here")
def test_a_tiny_run_reports_every_case(capsys):
    assert main(TINY_ARGS) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("machine: ") and "loadavg" in lines[0]
    rows = {line[:14].strip(): line.split() for line in lines[3:]}
    assert list(rows) == list(CASES)
    for name, fields in rows.items():
        native_ms, torch_ms, ratio = float(fields[-3]), float(fields[-2]), fields[-1]
        assert native_ms >= 0 and torch_ms > 0, name
        assert ratio.endswith("x") and float(ratio[:-1]) >= 0, name
