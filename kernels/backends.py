"""Kernel backends: one object per kernel family owns every kernel a model layer calls.
`kernels/selection.py` picks the family for a device once; the layers call only the
backend object they were built with.

Semantics of the layer ops (shapes as the layers pass them):
    rms_norm(x, residual, weight, eps, pending=None) -> (normed, new residual)
        x, residual [T, hidden]; roundings as torch_layers.rms_norm. `pending`: the
        LoRA expand x's projection left undone (lora.py `PendingExpand`), added to x
        first (inside the norm's kernel on the Triton backend).
    silu_and_mul(x, pending=None) -> silu(gate) * up where gate, up = x.chunk(2, -1)
        x [T, 2I] (the fused gate/up output) -> [T, I]; `pending` as for rms_norm.
    rotary_write_kv(q, k, v, cos, sin, kv_cache, slot_mapping) -> (q, k) rotated
        q [T, H, Dh], k / v [T, Hkv, Dh], cos / sin [T, 1, Dh/2] in the model dtype;
        also writes k (rotated) and v to their cache slots.
    attention(q, k, v, kv_cache, meta, scale) -> out [T, H, Dh]
        the step's tokens in the layout of attention_metadata.py; every token's K/V is
        already in kv_cache [2, N, Hkv, B, Dh].
    greedy_tokens(logits) -> [2, S] int64
        logits [S, V]; row 0 the first index of each row's maximum, row 1 1 where that
        maximum is finite and the row holds no NaN, else 0 (the index is then any).

And of the LoRA ops (layout in lora.py):
    lora_stack(max_loras, max_rank, in_features, output_sizes, dtype, device)
        -> zeroed LoRAStack in this backend's layout and slot dtype (`dtype` is the
        projection's weight dtype).
    add_lora(out, x, stack, batch): out [T, out] += each token's adapter delta of
        x [T, in], in place; nothing when the batch uses no adapter.
    folds_lora_shrink(stack) -> whether a projection keeps `stack.a` as rows appended
        to its weight (platform/layers/linear.py `fold_lora_shrink`), so that one
        matmul gives its base output and every slot's shrink.
    uses_folded_shrink(batch) -> whether a folded projection serves `batch` that way
        (else it runs its weight rows alone, then `add_lora`).
    expand_folded(out, shrunk, stack, batch): out [T, out] += each token's expand of
        its own slot's shrink, shrunk [T, L, R] (every slot's); in place.

Register another family with `@register_backend("name")`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Protocol

import torch

from loraplex.kernels import torch_layers
from loraplex.kernels import torch_paged_attention as torch_attention
from loraplex.kernels.attention_metadata import AttentionMetadata
from loraplex.kernels.lora import (
    LoRABatch,
    LoRAStack,
    PendingExpand,
    cpu_add_lora,
    foldable_shrink,
    torch_add_lora,
    triton_add_lora,
    triton_expand_folded,
)

_HALF = (torch.bfloat16, torch.float16)


class KernelBackend(Protocol):
    name: str

    def rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        pending: PendingExpand | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_and_mul(
        self, x: torch.Tensor, pending: PendingExpand | None = None
    ) -> torch.Tensor: ...

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

    def greedy_tokens(self, logits: torch.Tensor) -> torch.Tensor: ...

    def lora_stack(
        self,
        max_loras: int,
        max_rank: int,
        in_features: int,
        output_sizes: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> LoRAStack: ...

    def add_lora(
        self, out: torch.Tensor, x: torch.Tensor, stack: LoRAStack, batch: LoRABatch
    ) -> None: ...

    def folds_lora_shrink(self, stack: LoRAStack) -> bool: ...

    def uses_folded_shrink(self, batch: LoRABatch) -> bool: ...

    def expand_folded(
        self, out: torch.Tensor, shrunk: torch.Tensor, stack: LoRAStack, batch: LoRABatch
    ) -> None: ...


_REGISTRY: dict[str, Callable[[], KernelBackend]] = {}
_INSTANCES: dict[str, KernelBackend] = {}


def register_backend(name: str) -> Callable[[type], type]:
    """Class decorator: `get_backend(name)` builds (once) and returns this class."""

    def register(cls: type) -> type:
        _REGISTRY[name] = cls
        return cls

    return register


def get_backend(name: str) -> KernelBackend:
    """The shared (stateless) backend called `name`; ValueError naming the registered
    ones."""
    if name not in _INSTANCES:
        try:
            factory = _REGISTRY[name]
        except KeyError:
            raise ValueError(
                f"unknown kernel backend {name!r}; registered: {sorted(_REGISTRY)}"
            ) from None
        _INSTANCES[name] = factory()
    return _INSTANCES[name]


@register_backend("torch")
class TorchBackend:
    """Plain torch ops: the reference path, and the CPU path where the native kernels
    cannot be built. A half-precision model keeps its adapter slots in fp32, as PEFT
    keeps adapter weights: tiny fp32 matmuls cost less per call on a CPU, and the delta
    is rounded only once."""

    name = "torch"

    def rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        pending: PendingExpand | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return torch_layers.rms_norm(_expanded(x, pending), residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor, pending: PendingExpand | None = None) -> torch.Tensor:
        return torch_layers.silu_and_mul(_expanded(x, pending))

    def greedy_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        best, tokens = logits.max(dim=-1)
        return torch.stack((tokens, torch.isfinite(best).to(torch.int64)))

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
        q, k = torch_layers.apply_rotary(q, cos, sin), torch_layers.apply_rotary(k, cos, sin)
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

    def lora_stack(
        self,
        max_loras: int,
        max_rank: int,
        in_features: int,
        output_sizes: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> LoRAStack:
        width = len(output_sizes) * max_rank
        dtype = self._slot_dtype(dtype)
        slice_ends = tuple(itertools.accumulate(output_sizes))
        return LoRAStack(
            a=torch.zeros(max_loras, width, in_features, dtype=dtype, device=device),
            b=self._zeros_b(max_loras, slice_ends[-1], width, dtype, device),
            slice_ends=slice_ends,
        )

    def _slot_dtype(self, weight_dtype: torch.dtype) -> torch.dtype:
        """fp32 slots for a half-precision model (see the class docstring)."""
        return torch.float32 if weight_dtype in _HALF else weight_dtype

    def _zeros_b(
        self,
        max_loras: int,
        out_features: int,
        width: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        return torch.zeros(max_loras, out_features, width, dtype=dtype, device=device)

    def add_lora(
        self, out: torch.Tensor, x: torch.Tensor, stack: LoRAStack, batch: LoRABatch
    ) -> None:
        if not batch.empty:
            torch_add_lora(out, x, stack.a, stack.b, batch, stack.num_slices)

    def folds_lora_shrink(self, stack: LoRAStack) -> bool:
        """No folding: a CPU matmul's cost grows with every appended column, and the
        slots may be wider than the weight (fp32 for a half model)."""
        return False

    def uses_folded_shrink(self, batch: LoRABatch) -> bool:
        return False

    def expand_folded(
        self, out: torch.Tensor, shrunk: torch.Tensor, stack: LoRAStack, batch: LoRABatch
    ) -> None:
        """The folded expand in plain torch (`PendingExpand.apply`), should a projection
        fold without this backend choosing to."""
        out.copy_(PendingExpand(shrunk, stack.b, batch.token_slots).apply(out))


@register_backend("cpu")
class CpuBackend(TorchBackend):
    """The torch path with its hot spots in native code (kernels/cpu_ops.py): fused
    RMSNorm + residual, SiLU-and-mul, rotary + cache write in place, paged attention
    reading each K/V block where it lies instead of gathering a batch copy, greedy
    tokens in one vectorized pass per row (torch's max with indices is a scalar loop
    here), and LoRA over fp32 slots whose B is stored rank-major."""

    name = "cpu"

    def __init__(self) -> None:
        from loraplex.kernels import cpu_ops

        cpu_ops.ops()  # builds or loads them now; RuntimeError if impossible here
        self._ops = cpu_ops

    def rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        pending: PendingExpand | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._ops.rms_norm(_expanded(x, pending), residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor, pending: PendingExpand | None = None) -> torch.Tensor:
        return self._ops.silu_and_mul(_expanded(x, pending))

    def greedy_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        return self._ops.greedy_tokens(logits)

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
        """Decodes through the native paged decode kernel, prefill chunks through its
        prefill kernel: tiles of a chunk's tokens share each K/V block of the sequence
        where it lies in the cache (its chunk's K/V are already there), so chunks with
        and without cached prefix need no gather, and CPU SDPA's slow small-chunk
        shapes are avoided."""
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
            query_lens, seq_lens = prefill_lens(meta)
            self._ops.paged_prefill_attention(
                q[num_decodes:],
                kv_cache,
                meta.prefill_block_tables,
                query_lens,
                seq_lens,
                scale,
                out[num_decodes:],
            )
        return out

    def _zeros_b(
        self,
        max_loras: int,
        out_features: int,
        width: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        rank_major = torch.zeros(max_loras, width, out_features, dtype=dtype, device=device)
        return rank_major.transpose(1, 2)

    def add_lora(
        self, out: torch.Tensor, x: torch.Tensor, stack: LoRAStack, batch: LoRABatch
    ) -> None:
        if not batch.empty:
            cpu_add_lora(out, x, stack.a, stack.b, batch, stack.slice_ends)


@register_backend("triton")
class TritonBackend(TorchBackend):
    """Fused RMSNorm + residual, fused rotary + cache write, paged attention that reads
    K/V in place from the cache (kernels/rms_norm.py, rotary_kv.py, paged_attention.py),
    and BGMV / SGMV LoRA over slots in the model's dtype (triton_lora.py). Decodes and
    prefill chunks write into one output tensor."""

    name = "triton"

    def __init__(self) -> None:
        from loraplex.kernels import paged_attention, rms_norm, rotary_kv, silu_and_mul

        self._attention = paged_attention
        self._rms_norm = rms_norm.rms_norm
        self._silu_and_mul = silu_and_mul.silu_and_mul
        self._rotary_write_kv = rotary_kv.rotary_write_kv

    def rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        pending: PendingExpand | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A pending expand (o_proj's, down_proj's) is added inside the norm's kernel: a
        decode graph's step saves the expand kernel's launch."""
        return self._rms_norm(x, residual, weight, eps, pending)

    def silu_and_mul(self, x: torch.Tensor, pending: PendingExpand | None = None) -> torch.Tensor:
        """One kernel (kernels/silu_and_mul.py), not torch's two; gate/up's pending
        expand inside it (one kernel, not three)."""
        return self._silu_and_mul(x, pending)

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

    def _slot_dtype(self, weight_dtype: torch.dtype) -> torch.dtype:
        """Slots in the model's dtype: the BGMV / SGMV kernels read them as they are."""
        return weight_dtype

    def add_lora(
        self, out: torch.Tensor, x: torch.Tensor, stack: LoRAStack, batch: LoRABatch
    ) -> None:
        if not batch.empty:
            triton_add_lora(out, x, stack.a, stack.b, batch)

    def folds_lora_shrink(self, stack: LoRAStack) -> bool:
        """Folded when every slot's shrink is cheap enough to compute for every token
        (`lora.foldable_shrink`): appending the A rows then costs a few percent of the
        projection's matmul, against the shrink kernel's launch and its own pass over x
        (H100, Llama-3.2-1B decode step: +24-40 us folded against +367-405 us as its
        own matmuls, docs/benchmarks.md)."""
        return foldable_shrink(stack.a)

    def uses_folded_shrink(self, batch: LoRABatch) -> bool:
        """Steps of segments alone: prefill steps, and a decode graph past `max_loras`
        decodes (its segment table). BGMV decode tokens keep their own kernels."""
        return batch.num_decode_tokens == 0 and batch.max_seg_len > 0

    def expand_folded(
        self, out: torch.Tensor, shrunk: torch.Tensor, stack: LoRAStack, batch: LoRABatch
    ) -> None:
        triton_expand_folded(out, shrunk, stack.b, batch)


def _expanded(x: torch.Tensor, pending: PendingExpand | None) -> torch.Tensor:
    """x plus its pending LoRA expand in plain torch (where a backend has no fused form)."""
    return x if pending is None else pending.apply(x)


_PREFILL_LENS = "cpu_prefill_lens"


def prefill_lens(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's prefill query lengths and sequence lengths as int64 tensors [P], made
    once per step (in `meta.cache`)."""
    if _PREFILL_LENS not in meta.cache:
        device = meta.prefill_block_tables.device
        meta.cache[_PREFILL_LENS] = torch.tensor(
            [meta.prefill_query_lens, meta.prefill_seq_lens], dtype=torch.int64, device=device
        )
    lens = meta.cache[_PREFILL_LENS]
    return lens[0], lens[1]
