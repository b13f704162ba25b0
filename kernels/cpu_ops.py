"""Native CPU kernels (csrc/cpu_ops.cpp) behind plain Python functions.

The sources (csrc/cpu_ops.cpp, and csrc/decoder_stack.cpp, which chains those kernels
and oneDNN's projections into a model's layer loop) are compiled once per machine and
torch version with torch's C++ extension builder (g++ and ninja; `-O3 -march=native`)
into `$LORAPLEX_CACHE_DIR/torch_extensions/<name>`, where <name> hashes the sources, the
torch version, the compiler flags and the CPU, so a cache shared between different
machines never loads code built for another CPU. The first build takes about 13 s on
2 cores and logs that it is happening; later processes load the built library in well
under a second. Concurrent builders wait on a file lock in that folder.

`load()` returns False (and logs why, once) when the build is impossible here, e.g.
no C++ compiler: the engine then runs the plain torch path, which has the same
semantics. The ops register as torch.ops.loraplex_cpu.*; each function below states
its semantics and shapes, and tests/kernels/test_cpu_ops.py checks them against the
torch code they replace.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from filelock import FileLock

from loraplex.kernels.cache_dir import cache_base

logger = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).resolve().parent / "csrc" / name for name in ("cpu_ops.cpp", "decoder_stack.cpp")
)
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp")


def cpu_identity() -> str:
    """The CPU model and feature flags (what -march=native compiles for)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor() or platform.machine()
    return f"{fields.get('model name', '')}|{fields.get('flags', '')}"


def build_name() -> str:
    """Extension name: changes with the sources, torch, the flags and the CPU."""
    digest = hashlib.sha256()
    sources = [source.read_bytes() for source in SOURCES]
    for part in (*sources, torch.__version__.encode(), " ".join(CFLAGS).encode()):
        digest.update(part)
    digest.update(cpu_identity().encode())
    return f"loraplex_cpu_ops_{digest.hexdigest()[:16]}"


def build_root() -> Path:
    return cache_base() / "torch_extensions"


@functools.cache
def load() -> bool:
    """Builds (first time) and loads the ops into this process; True when they are
    usable. Never raises: a failed build is logged and the torch path stays in use."""
    try:
        from torch.utils import cpp_extension

        name = build_name()
        folder = build_root() / name
        folder.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        # One builder at a time, under a lock the OS releases if its holder dies. torch's
        # own lock file in the folder is not: one left by a process killed mid-build
        # would make every later load wait forever, so it is removed under ours.
        with FileLock(str(folder / "loraplex-build.lock")):
            (folder / "lock").unlink(missing_ok=True)
            if not any(folder.glob(f"{name}*.so")):
                logger.info("building native CPU kernels into %s (once per machine)", folder)
            cpp_extension.load(
                name=name,
                sources=[str(source) for source in SOURCES],
                extra_cflags=list(CFLAGS),
                build_directory=str(folder),
                is_python_module=False,
                verbose=False,
            )
        logger.info("native CPU kernels ready in %.1f s", time.perf_counter() - started)
        return True
    except Exception as error:  # noqa: BLE001 - any build failure means "use the torch path"
        # Compiler output can run to pages; its end names the failure.
        logger.warning(
            "native CPU kernels unavailable, using the torch path: %s", str(error)[-3000:]
        )
        return False


def ops():
    """torch.ops.loraplex_cpu, built and loaded on first use; RuntimeError when the build
    is impossible here (callers pick the 'cpu' backend only after `load()` succeeded)."""
    if not load():
        raise RuntimeError("the native CPU kernels could not be built (see the log)")
    return torch.ops.loraplex_cpu


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """Semantics: out[d, h] = softmax(scale * q[d, h] . K_d[:, h // G]) @ V_d[:, h // G]
    over the keys 0 .. seq_lens[d] - 1 of sequence d, each read once where it lies in
    the cache (no gather). As torch_paged_attention.decode_attention.

    q [D, H, Dh] (contiguous last dim); kv_cache [2, N, Hkv, B, Dh]; block_tables [D, W]
    int64; seq_lens [D] int64 in 1 .. W * B; out [D, H, Dh] is written and returned."""
    ops().paged_decode_attention(q, kv_cache, block_tables, seq_lens, scale, out)
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """Semantics: prefill chunk p holds query_lens[p] consecutive tokens of q (chunks in
    order), the last at position seq_lens[p] - 1; its token at position a gets
    out[t, h] = softmax(scale * q[t, h] . K_p[0..a, h // G]) @ V_p[0..a, h // G], every
    K/V already in the cache: `paged_decode_attention` of each token as a decode of
    length a + 1, up to fp32 summation order, computed over tiles of 16 tokens that
    share each K/V block.

    q [Tp, H, Dh] (contiguous last dim); kv_cache [2, N, Hkv, B, Dh]; block_tables
    [P, W], query_lens / seq_lens [P] int64; out [Tp, H, Dh] is written and returned."""
    ops().paged_prefill_attention(q, kv_cache, block_tables, query_lens, seq_lens, scale, out)
    return out


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: s = residual + x (rounded to the dtype; x without residual),
    out = weight * dtype(float(s) / sqrt(mean(float(s)^2) + eps)) -> (out, s).
    x, residual [T, hidden] contiguous; weight [hidden]. As torch_layers.rms_norm."""
    out = torch.empty_like(x)
    residual_out = None if residual is None else torch.empty_like(x)
    ops().rms_norm(x, residual, weight, eps, out, residual_out)
    return out, x if residual_out is None else residual_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Semantics: gate, up = x.chunk(2, -1) -> F.silu(gate) * up (silu rounded to the
    dtype before the product). x [T, 2I] contiguous -> [T, I]."""
    return ops().silu_and_mul(x)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Semantics: per row s of logits [S, V] (last dim contiguous) -> [2, S] int64:
    row 0 the first index of the row's maximum (torch.max(logits, -1).indices), row 1
    1 where that maximum is finite and the row holds no NaN, else 0 (its index then 0).
    One pass for the maximum and one up to its first index, rows in parallel."""
    out = torch.empty(2, logits.shape[0], dtype=torch.int64)
    ops().greedy_tokens(logits, out)
    return out


def rotary_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Semantics: q and k rotated in place as kernels/torch_layers.apply_rotary does,
    then kv_cache[0 / 1, s // B, :, s % B] = k[t] / v[t] for s = slot_mapping[t] >= 0.
    q [T, H, Dh], k / v [T, Hkv, Dh] (contiguous last dims); cos / sin [T, Dh/2];
    kv_cache [2, N, Hkv, B, Dh]; slot_mapping [T] int64."""
    ops().rotary_write_kv(q, k, v, cos, sin, kv_cache, slot_mapping)


def lora_add(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    slot_ranks: torch.Tensor | None,
    slice_ends: Sequence[int],
) -> None:
    """Semantics (per token, see kernels/lora.py): with s = token_slots[t] >= 0,
    S = len(slice_ends) and w = min(R, S * slot_ranks[s]) (R without slot_ranks):
        out[t] += dtype(lora_b[s, :, :w] @ (lora_a[s, :w] @ x[t]))
    where lora_b[s] is block-diagonal by slice: output columns up to slice_ends[i] (and
    from slice_ends[i - 1]) read only rank columns i * w / S .. (i + 1) * w / S, and
    the kernel skips the zero blocks. slice_ends increase; the last is out's width.
    x [T, in], out [T, out] (model dtype); lora_a [L, R, in] fp32; lora_b [L, out, R]
    fp32 stored rank-major (lora_b.stride(1) == 1); token_slots [T] int64, -1 = none;
    slot_ranks [L] int64 or None. In place on `out`. Decodes and prefill chunks alike:
    tokens of one slot are processed in runs that share each A row and B column."""
    ranks = slot_ranks if slot_ranks is not None else token_slots.new_empty(0)
    ops().lora_add(out, x, lora_a, lora_b, token_slots, ranks, list(slice_ends))


def quantize_rows_int8(
    x: torch.Tensor, input_scales: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: per row t of x [T, K] (contiguous), v = x[t] * input_scales (fp32, per
    channel; x[t] without them), a = max_k |v[k]| / 127 (1 where that is 0) and
    q[t] = round(v / a) in [-127, 127] -> (q [T, K] int8, a [T, 1] float32). As
    kernels/int8_matmul.py's torch path."""
    quantized = torch.empty(x.shape, dtype=torch.int8)
    scales = torch.empty(x.shape[0], 1, dtype=torch.float32)
    ops().quantize_rows_int8(x, input_scales, quantized, scales)
    return quantized, scales


def int8_linear_rows(
    x: torch.Tensor,
    input_scales: torch.Tensor | None,
    packed: torch.Tensor,
    col_sums: torch.Tensor,
    col_scales: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
) -> torch.Tensor:
    """Semantics: `dequantize_int32(torch._int_mm(*quantize_rows_int8(x, input_scales))
    @ W.T ...)` bit for bit: x [T, K] (contiguous) quantized per row (times the optional
    per-channel input_scales [K]), times the int8 weight W [N, K] given packed for VNNI
    (`int8_matmul.pack_vnni`: [ceil(N/16), ceil(K/4), 16, 4]) with col_sums [N] int32 =
    W.sum(1), int32 accumulation, then * row scale * col_scales [N] (+ bias [N] in x's
    dtype) -> [T, N] in x's dtype. Made for a few rows (decode at a small batch): each
    weight byte is read once per 4 rows, at memory speed."""
    out = torch.empty(x.shape[0], out_features, dtype=x.dtype)
    ops().int8_linear_rows(x, input_scales, packed, col_sums, col_scales, bias, out)
    return out


def dequantize_int32(
    acc: torch.Tensor,
    row_scales: torch.Tensor,
    col_scales: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Semantics: dtype(float(acc) * row_scales * col_scales) (+ bias in `dtype`): acc
    [T, N] int32, row_scales [T, 1] and col_scales [N] float32, bias [N] -> [T, N]."""
    out = torch.empty(acc.shape, dtype=dtype)
    ops().dequantize_int32(acc, row_scales, col_scales, bias, out)
    return out


def dequantize_int4(
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    in_features: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Semantics: W [N, K] in `dtype`, W[n, k] = (q[n, k] - zeros[n, k // g]) *
    scales[n, k // g] in fp32 (zeros 0 where None), q the int4 values of packed [N,
    ceil(K / 8)] int32 (kernels/int4_matmul.py's `pack_int4` layout); scales [N, G] fp32,
    zeros [N, G] int8, G = ceil(K / g). As kernels/int4_matmul.py's `dequantize_int4`."""
    out = torch.empty(packed.shape[0], in_features, dtype=dtype)
    ops().dequantize_int4(packed, scales, zeros, group_size, out)
    return out
