"""The per-layer kernels a decoder layer calls, behind one interface with a torch and a
Triton implementation (picked per engine by `kernels/selection.py`).

    rms_norm(x, residual, weight, eps) -> (normed, new residual)
        x, residual [T, hidden]; see kernels/rms_norm.py for the exact roundings.
    silu_and_mul(x) -> silu(gate) * up where gate, up = x.chunk(2, -1)
        x [T, 2I] (the fused gate/up output) -> [T, I].
    rotary_write_kv(q, k, v, cos, sin, kv_cache, slot_mapping) -> (q, k) rotated
        q [T, H, Dh], k / v [T, Hkv, Dh], cos / sin [T, 1, Dh/2] in the model dtype;
        also writes k (rotated) and v to their cache slots.
    attention(q, k, v, kv_cache, meta, scale) -> out [T, H, Dh]
        the step's tokens in the layout of attention_metadata.py; every token's K/V is
        already in kv_cache [2, N, Hkv, B, Dh].

Register another implementation with `@register_layer_kernels("name")`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from loraplex.kernels import torch_paged_attention as torch_attention
from loraplex.platform.attention_metadata import AttentionMetadata
from loraplex.platform.layers.rotary import apply_rotary


class LayerKernels(Protocol):
    def rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor: ...

    def rotary_write_kv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


_REGISTRY: dict[str, Callable[[], LayerKernels]] = {}
_INSTANCES: dict[str, LayerKernels] = {}


def register_layer_kernels(name: str) -> Callable[[type], type]:
    """Class decorator: `get_layer_kernels(name)` builds (once) and returns this class."""

    def register(cls: type) -> type:
        _REGISTRY[name] = cls
        return cls

    return register


def get_layer_kernels(name: str) -> LayerKernels:
    """The shared (stateless) instance for `name`; ValueError naming the registered ones."""
    if name not in _INSTANCES:
        try:
            factory = _REGISTRY[name]
        except KeyError:
            raise ValueError(
                f"unknown kernel backend {name!r}; registered: {sorted(_REGISTRY)}"
            ) from None
        _INSTANCES[name] = factory()
    return _INSTANCES[name]


def torch_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] -> F.silu(gate) * up [T, I] with gate, up = x.chunk(2, -1)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@register_layer_kernels("torch")
class TorchLayerKernels:
    """Plain torch ops: the CPU path (and the reference the Triton path must match)."""

    def rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference the Triton kernel is tested against (kernels/rms_norm.py)."""
        if residual is not None:
            x = residual + x
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype), x

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return torch_silu_and_mul(x)

    def rotary_write_kv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        torch_attention.write_kv(kv_cache, k, v, slot_mapping)
        return q, k

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Vectorized decodes, then SDPA over the prefill chunks (torch_paged_attention)."""
        num_decodes = meta.num_decode_tokens
        if meta.num_prefills == 0:
            return torch_attention.decode_attention(
                q, kv_cache, meta.decode_block_tables, meta.decode_seq_lens, scale, meta.cache
            )
        prefill_out = torch_attention.prefill_attention(
            q[num_decodes:],
            k[num_decodes:],
            v[num_decodes:],
            kv_cache,
            meta.prefill_block_tables,
            meta.prefill_query_lens,
            meta.prefill_seq_lens,
            scale,
            meta.cache,
        )
        if num_decodes == 0:
            return prefill_out
        decode_out = torch_attention.decode_attention(
            q[:num_decodes],
            kv_cache,
            meta.decode_block_tables,
            meta.decode_seq_lens,
            scale,
            meta.cache,
        )
        return torch.cat((decode_out, prefill_out), dim=0)


@register_layer_kernels("triton")
class TritonLayerKernels:
    """Fused RMSNorm + residual, fused rotary + cache write, and paged attention that
    reads K/V in place from the cache (kernels/rms_norm.py, rotary_kv.py,
    paged_attention.py). Decodes and prefill chunks write into one output tensor."""

    def __init__(self) -> None:
        from loraplex.kernels import paged_attention, rms_norm, rotary_kv

        self._attention = paged_attention
        self._rms_norm = rms_norm.rms_norm
        self._rotary_write_kv = rotary_kv.rotary_write_kv

    def rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return torch_silu_and_mul(x)

    def rotary_write_kv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._rotary_write_kv(q, k, v, cos.squeeze(1), sin.squeeze(1), kv_cache, slot_mapping)
        return q, k

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        num_decodes = meta.num_decode_tokens
        if num_decodes:
            self._attention.decode_attention(
                q[:num_decodes],
                kv_cache,
                meta.decode_block_tables,
                meta.decode_seq_lens,
                scale,
                out=out[:num_decodes],
                scratch=meta.cache,
            )
        if meta.num_prefills:
            self._attention.prefill_attention(
                q[num_decodes:],
                kv_cache,
                meta.prefill_block_tables,
                meta.prefill_query_lens,
                meta.prefill_seq_lens,
                scale,
                out=out[num_decodes:],
                scratch=meta.cache,
            )
        return out


@register_layer_kernels("cpu")
class CpuLayerKernels(TorchLayerKernels):
    """The torch path with its hot spots in native code (kernels/cpu_ops.py): fused
    RMSNorm + residual, SiLU-and-mul, rotary + cache write in place, and paged
    attention reading each K/V block where it lies instead of gathering a batch copy."""

    def __init__(self) -> None:
        from loraplex.kernels import cpu_ops

        cpu_ops.ops()  # builds or loads them now; RuntimeError if impossible here
        self._ops = cpu_ops

    def rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._ops.rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._ops.silu_and_mul(x)

    def rotary_write_kv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._ops.rotary_write_kv(q, k, v, cos.squeeze(1), sin.squeeze(1), kv_cache, slot_mapping)
        return q, k

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Every token through the native paged kernel: a prefill token at position a
        attends like a decode of length a + 1 over its sequence's block table (its
        chunk's K/V are already in the cache), so chunks with and without cached prefix
        need no gather. Prefill steps of the default model (16 fresh 128-token chunks)
        went from 1.0-1.25 s to 0.72-0.92 s in bf16 on the 2-core dev VM, against
        CPU SDPA (its flash kernel runs these shapes at ~25 GFLOPS)."""
        out = q.new_empty(q.shape)
        num_decodes = meta.num_decode_tokens
        if num_decodes:
            self._ops.paged_decode_attention(
                q[:num_decodes],
                kv_cache,
                meta.decode_block_tables,
                meta.decode_seq_lens,
                scale,
                out[:num_decodes],
            )
        if meta.num_prefills:
            tables, lens = prefill_rows_as_decodes(meta)
            self._ops.paged_decode_attention(
                q[num_decodes:], kv_cache, tables, lens, scale, out[num_decodes:]
            )
        return out


_PREFILL_TABLES = "cpu_prefill_tables"
_PREFILL_LENS = "cpu_prefill_lens"


def prefill_rows_as_decodes(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Per prefill token: its sequence's block table row [Tp, W] and the number of keys
    it sees [Tp] (position + 1), computed once per step (in `meta.cache`)."""
    if _PREFILL_TABLES not in meta.cache:
        device = meta.prefill_block_tables.device
        query_lens = torch.tensor(meta.prefill_query_lens, dtype=torch.int64, device=device)
        seq_lens = torch.tensor(meta.prefill_seq_lens, dtype=torch.int64, device=device)
        tables = meta.prefill_block_tables.repeat_interleave(query_lens, dim=0)
        first_lens = (seq_lens - query_lens + 1).repeat_interleave(query_lens)
        chunk_starts = (query_lens.cumsum(0) - query_lens).repeat_interleave(query_lens)
        index = torch.arange(int(query_lens.sum()), device=device)
        meta.cache[_PREFILL_TABLES] = tables
        meta.cache[_PREFILL_LENS] = first_lens + index - chunk_starts
    return meta.cache[_PREFILL_TABLES], meta.cache[_PREFILL_LENS]
