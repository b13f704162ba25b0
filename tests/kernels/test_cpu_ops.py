"""Native CPU kernels (kernels/cpu_ops.py) against the torch code they replace and the
float64 attention oracle (decode and prefill-chunk attention).

The build must succeed here: this machine and CI have g++, so a failed build is a test
failure, not a skip. Attention covers the AVX-512 head sizes (64, 128) and the
portable loop (24), GQA groups 1 / 3 / 8, block sizes 1 / 16 / 32, length 1 and block
edges; unwritten cache slots hold NaN, so a read past a sequence's length shows.
Elementwise ops: fp32 within 1e-6 (rotary bit for bit: same expression, no fp
contraction), bf16 / fp16 within one ulp of values of order 1.
"""

from __future__ import annotations

import itertools
import shutil
import subprocess

import pytest
import torch

from loraplex.kernels import cpu_ops
from loraplex.kernels.backends import get_backend
from loraplex.kernels.reference import reference_paged_attention
from loraplex.kernels.torch_layers import apply_rotary
from loraplex.kernels.torch_paged_attention import write_kv

torch_kernels = get_backend("torch")
HALF = [torch.bfloat16, torch.float16]
ULP = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_ops.load(), "the native CPU kernels did not build (see the log)"


def paged_cache(seq_lens, num_kv_heads, head_dim, block_size, dtype, gen):
    """A NaN-filled cache where only each sequence's first seq_lens[s] slots hold
    values, through shuffled block tables -> (cache, tables [S, W])."""
    width = max(-(-n // block_size) for n in seq_lens)
    num_blocks = width * len(seq_lens) + 3
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (2, num_blocks, num_kv_heads, block_size, head_dim)
    cache = torch.full(shape, float("nan"), dtype=dtype)
    tables = []
    for seq_len in seq_lens:
        count = -(-seq_len // block_size)
        table, pool = pool[:count], pool[count:]
        slots = torch.tensor(
            [table[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        )
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        write_kv(cache, k, v, slots)
        tables.append(table + [0] * (width - count))
    return cache, torch.tensor(tables, dtype=torch.int64)


ATTENTION_DTYPES = pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
ATTENTION_HEADS = pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim",
    [(9, 3, 64), (4, 4, 64), (8, 1, 128), (6, 2, 24)],
    ids=["gqa3-d64", "mha-d64", "gqa8-d128", "gqa3-d24"],
)
BLOCK_SIZES = pytest.mark.parametrize("block_size", [1, 16, 32])
ATTENTION_TOLERANCE = {
    torch.float32: {"atol": 2e-6, "rtol": 1e-5},
    torch.bfloat16: {"atol": 1e-2, "rtol": 1e-2},
    torch.float16: {"atol": 1e-2, "rtol": 1e-2},
}


@ATTENTION_DTYPES
@ATTENTION_HEADS
@BLOCK_SIZES
def test_decode_attention_matches_reference(dtype, num_heads, num_kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(block_size * 7 + head_dim)
    seq_lens = [1, block_size, block_size + 1, 3 * block_size - 1, 50]
    cache, tables = paged_cache(seq_lens, num_kv_heads, head_dim, block_size, dtype, gen)
    # q as a strided view into a wider fused projection output, as the engine passes it.
    fused = torch.randn(len(seq_lens), num_heads + 2, head_dim, generator=gen).to(dtype)
    q = fused[:, :num_heads]
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    scale = head_dim**-0.5
    cpu_ops.paged_decode_attention(
        q, cache, tables, torch.tensor(seq_lens, dtype=torch.int64), scale, out
    )
    rows = [t[: -(-n // block_size)] for t, n in zip(tables.tolist(), seq_lens, strict=True)]
    expected = reference_paged_attention(q, cache, rows, seq_lens, [1] * len(seq_lens), scale)
    tol = ATTENTION_TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), **tol)


def test_decode_attention_rejects_bad_lengths():
    gen = torch.Generator().manual_seed(0)
    cache, tables = paged_cache([5], 1, 64, 4, torch.float32, gen)
    q = torch.randn(1, 2, 64)
    for bad in (0, tables.shape[1] * 4 + 1):
        with pytest.raises(RuntimeError, match="seq_lens"):
            cpu_ops.paged_decode_attention(
                q, cache, tables, torch.tensor([bad]), 0.1, torch.empty_like(q)
            )
    with pytest.raises(RuntimeError, match="share a dtype"):
        cpu_ops.paged_decode_attention(
            q.double(), cache, tables, torch.tensor([5]), 0.1, torch.empty_like(q.double())
        )


PREFILL_CHUNKS = [(1, 1), (17, 17), (5, 40), (40, 50), (33, 33), (16, 70)]
"""(query_len, seq_len) per chunk: one token, tiles of 16 with a remainder, chunks after
a cached prefix, a chunk of exactly one tile."""


@ATTENTION_DTYPES
@ATTENTION_HEADS
@BLOCK_SIZES
def test_prefill_attention_matches_reference(dtype, num_heads, num_kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(block_size * 5 + head_dim)
    query_lens = [q for q, _ in PREFILL_CHUNKS]
    seq_lens = [n for _, n in PREFILL_CHUNKS]
    cache, tables = paged_cache(seq_lens, num_kv_heads, head_dim, block_size, dtype, gen)
    fused = torch.randn(sum(query_lens), num_heads + 2, head_dim, generator=gen).to(dtype)
    q = fused[:, 1 : num_heads + 1]
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    scale = head_dim**-0.5
    lens = [torch.tensor(x, dtype=torch.int64) for x in (query_lens, seq_lens)]
    cpu_ops.paged_prefill_attention(q, cache, tables, *lens, scale, out)
    rows = [t[: -(-n // block_size)] for t, n in zip(tables.tolist(), seq_lens, strict=True)]
    expected = reference_paged_attention(q, cache, rows, seq_lens, query_lens, scale)
    tol = ATTENTION_TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), **tol)
    # The decode kernel over each token as a decode of its prefix length agrees too.
    starts = [n - q for q, n in PREFILL_CHUNKS]
    token_tables = tables.repeat_interleave(lens[0], dim=0)
    token_lens = torch.tensor(
        [s + i + 1 for s, q in zip(starts, query_lens, strict=True) for i in range(q)]
    )
    as_decodes = torch.empty_like(out)
    cpu_ops.paged_decode_attention(q, cache, token_tables, token_lens, scale, as_decodes)
    torch.testing.assert_close(out.float(), as_decodes.float(), **tol)


def test_prefill_attention_rejects_bad_lengths():
    gen = torch.Generator().manual_seed(0)
    cache, tables = paged_cache([5], 1, 64, 4, torch.float32, gen)
    q = torch.randn(3, 2, 64)
    for query_len, seq_len in ((3, 2), (3, tables.shape[1] * 4 + 1), (2, 5)):
        with pytest.raises(RuntimeError, match="query_len|q has"):
            cpu_ops.paged_prefill_attention(
                q,
                cache,
                tables,
                torch.tensor([query_len]),
                torch.tensor([seq_len]),
                0.1,
                torch.empty_like(q),
            )


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs binutils' objdump")
def test_decode_attention_prefetches_survive_compilation():
    """The decode kernel's software prefetches are in the built library. GCC deems an
    out-of-line function whose only effect is a prefetch pure and drops its calls: the
    kernel once shipped with none and read its cache blocks at half the speed."""
    library = next((cpu_ops.build_root() / cpu_ops.build_name()).glob("*.so"))
    listing = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", str(library)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert listing.count("prefetcht") >= 4


@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("hidden", [1, 100, 576])
def test_rms_norm_matches_torch_path(dtype, with_residual, hidden):
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(37, hidden, generator=gen) * 3).to(dtype)
    residual = torch.randn(37, hidden, generator=gen).to(dtype) if with_residual else None
    weight = torch.randn(hidden, generator=gen).to(dtype)
    out, new_residual = cpu_ops.rms_norm(x, residual, weight, 1e-5)
    expected, expected_residual = torch_kernels.rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(new_residual, expected_residual)
    # bf16 / fp16: the normalized value is rounded once before the weight product, so
    # one ulp there becomes up to |weight| ulps in the output.
    tol = ULP[dtype] * (1 if dtype == torch.float32 else 4)
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
def test_silu_and_mul_matches_torch_path(dtype):
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(33, 2 * 70, generator=gen) * 4).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    out = cpu_ops.silu_and_mul(x)
    expected = torch_kernels.silu_and_mul(x)
    assert out.shape == (33, 70) and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), atol=ULP[dtype], rtol=ULP[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
@pytest.mark.parametrize("vocab", [16, 37, 1000])
def test_greedy_tokens_match_torch_max(dtype, vocab):
    """First index of each row's maximum (ties included: values are rounded to a coarse
    grid so rows repeat their maximum), on a strided view; a row with a NaN, a +inf or
    no finite value is flagged, one with -inf entries beside finite ones is not."""
    gen = torch.Generator().manual_seed(vocab)
    wide = (torch.randn(12, vocab + 3, generator=gen) * 2).round().to(dtype)
    logits = wide[:, 1 : vocab + 1]
    logits[1, vocab // 2] = float("nan")
    logits[2, vocab - 1] = float("inf")
    logits[3] = float("-inf")
    logits[4, ::2] = float("-inf")
    out = cpu_ops.greedy_tokens(logits)
    best, expected = logits.float().max(dim=-1)
    finite = torch.isfinite(best)
    assert out[1].tolist() == finite.to(torch.int64).tolist()
    assert finite.tolist() == [True] + [False] * 3 + [True] * 8
    assert torch.equal(out[0][finite], expected[finite])
    ties = [row for row in range(12) if (logits[row].float() == best[row]).sum() > 1]
    assert ties, "the grid should give some rows a repeated maximum"


@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
def test_silu_and_mul_vector_lanes_equal_the_scalar_tail(dtype):
    """A row of width 17 runs 16 values in vector lanes and the last in the scalar loop:
    every value, moved to the last column, gives the same bits."""
    gen = torch.Generator().manual_seed(2)
    gate = (torch.randn(64, 17, generator=gen) * 6).to(dtype)
    up = torch.randn(64, 17, generator=gen).to(dtype)
    out = cpu_ops.silu_and_mul(torch.cat((gate, up), dim=1))
    for column in range(16):
        order = [c for c in range(17) if c != column] + [column]
        moved = cpu_ops.silu_and_mul(torch.cat((gate[:, order], up[:, order]), dim=1))
        assert torch.equal(moved[:, -1], out[:, column]), f"column {column}"


@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
def test_rotary_write_kv_matches_torch_path(dtype):
    gen = torch.Generator().manual_seed(2)
    tokens, num_heads, num_kv_heads, head_dim, block_size = 11, 6, 2, 32, 4
    fused = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    q, k, v = fused.to(dtype).split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1
    )
    q = q.view(tokens, num_heads, head_dim)
    k = k.view(tokens, num_kv_heads, head_dim)
    v = v.view(tokens, num_kv_heads, head_dim)
    angles = torch.rand(tokens, 1, head_dim // 2, generator=gen) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slots = torch.randperm(5 * block_size, generator=gen)[:tokens]
    slots[3] = -1
    expected_cache = torch.zeros(2, 5, num_kv_heads, block_size, head_dim, dtype=dtype)
    expected_q, expected_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    keep = slots >= 0
    write_kv(expected_cache, expected_k[keep], v[keep], slots[keep])
    cache = torch.zeros_like(expected_cache)
    cpu_ops.rotary_write_kv(q, k, v, cos.squeeze(1), sin.squeeze(1), cache, slots)
    assert torch.equal(q, expected_q)
    assert torch.equal(k, expected_k)
    assert torch.equal(cache, expected_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 3072), (91, 95)])
def test_lora_add_gives_a_token_the_same_delta_in_any_batch(dtype, in_features, out_features):
    """A token's LoRA delta is bit for bit the same alone or among 8 + 1 tokens of its
    slot (a full register block and a partial one), with and without feature tails:
    greedy outputs must not depend on what else a step holds."""
    gen = torch.Generator().manual_seed(in_features)
    slots, rank = 3, 8
    lora_a = torch.randn(slots, rank, in_features, generator=gen) * 0.1
    lora_b = (torch.randn(slots, rank, out_features, generator=gen) * 0.1).transpose(1, 2)
    x = torch.randn(9, in_features, generator=gen).to(dtype)
    base = torch.randn(9, out_features, generator=gen).to(dtype)
    token_slots = torch.full((9,), 1, dtype=torch.long)
    together = base.clone()
    cpu_ops.lora_add(together, x, lora_a, lora_b, token_slots, None, [out_features])
    for t in range(9):
        alone = base[t : t + 1].clone()
        cpu_ops.lora_add(alone, x[t : t + 1], lora_a, lora_b, token_slots[:1], None, [out_features])
        assert torch.equal(alone[0], together[t]), f"token {t}"
    assert not torch.equal(together, base)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("slice_sizes", [(64, 32, 32), (40, 24, 24), (48, 48), (16, 80)])
def test_lora_add_of_a_fused_projection_equals_the_plain_product(dtype, slice_sizes):
    """A fused projection's slots hold B block-diagonal by slice (kernels/lora.py), at
    each slot's own rank; the kernel reads only the blocks that can be nonzero. Slots of
    ranks 2, 4 and 8 (the width's), tokens of all three and of the base model in one
    batch, slice ends on and off the kernel's 32-column chunks: every delta equals the
    fp64 product of the whole A and B, so nothing nonzero is skipped."""
    gen = torch.Generator().manual_seed(sum(slice_sizes))
    in_features, max_rank, slices = 72, 8, len(slice_sizes)
    width, out_features = slices * max_rank, sum(slice_sizes)
    ranks = torch.tensor([2, 4, 8], dtype=torch.long)
    lora_a = torch.zeros(3, width, in_features)
    lora_b = torch.zeros(3, out_features, width)
    for slot, rank in enumerate(ranks.tolist()):
        start = 0
        for index, size in enumerate(slice_sizes):
            columns = slice(index * rank, index * rank + rank)
            lora_a[slot, columns] = torch.randn(rank, in_features, generator=gen)
            lora_b[slot, start : start + size, columns] = torch.randn(size, rank, generator=gen)
            start += size
    rank_major = lora_b.transpose(1, 2).contiguous().transpose(1, 2)
    token_slots = torch.tensor([0] * 9 + [1] * 3 + [-1] * 2 + [2] * 10, dtype=torch.long)
    x = torch.randn(len(token_slots), in_features, generator=gen).to(dtype)
    base = torch.randn(len(token_slots), out_features, generator=gen).to(dtype)
    out = base.clone()
    ends = list(itertools.accumulate(slice_sizes))
    cpu_ops.lora_add(out, x, lora_a, rank_major, token_slots, ranks, ends)
    expected = base.double()
    for t, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            y = lora_a[slot].double() @ x[t].double()
            expected[t] += lora_b[slot].double() @ y
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance / 10)
    assert torch.equal(out[12:14], base[12:14])


def test_cpu_layer_kernels_are_the_default_on_cpu(monkeypatch):
    from loraplex.kernels.selection import KERNEL_BACKEND_ENV, kernel_backend

    monkeypatch.delenv(KERNEL_BACKEND_ENV, raising=False)
    assert kernel_backend(torch.device("cpu")) == "cpu"
    monkeypatch.setenv(KERNEL_BACKEND_ENV, "torch")
    assert kernel_backend(torch.device("cpu")) == "torch"


def test_build_name_tracks_source_and_cpu(monkeypatch):
    name = cpu_ops.build_name()
    assert name.startswith("loraplex_cpu_ops_")
    monkeypatch.setattr(cpu_ops, "cpu_identity", lambda: "another cpu")
    assert cpu_ops.build_name() != name


def test_a_stale_build_lock_does_not_block_loading():
    """torch's lock file left by a builder killed mid-build must not make the next
    process wait forever (a fresh process, since `load` runs once per process). The
    check holds loraplex's builder lock: a load in another process of the session (a
    replica starting) holds torch's lock for as long as its own build step runs."""
    import subprocess
    import sys

    from filelock import FileLock

    folder = cpu_ops.build_root() / cpu_ops.build_name()
    with FileLock(str(folder / "loraplex-build.lock")):
        (folder / "lock").write_text("")
    code = "from loraplex.kernels import cpu_ops; raise SystemExit(0 if cpu_ops.load() else 1)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    with FileLock(str(folder / "loraplex-build.lock")):
        assert not (folder / "lock").exists()
