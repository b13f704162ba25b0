"""Attention front-end: writes the step's K/V into the paged cache, then attends.

Backends are plain classes registered by name (`register_attention_backend`), so a
Triton backend can sit beside the torch one and be picked per engine. A backend has

    write_kv(kv_cache, k, v, slot_mapping) -> None
    forward(q, k, v, kv_cache, meta, scale) -> out

with q [T, H, Dh], k / v [T, Hkv, Dh] (the step's tokens, laid out as described in
attention_metadata.py), kv_cache [2, N, B, Hkv, Dh] and out [T, H, Dh].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from loraplex.kernels import torch_paged_attention as torch_kernels
from loraplex.platform.attention_metadata import AttentionMetadata


class AttentionBackend(Protocol):
    def write_kv(
        self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None: ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_attention_backend(
    name: str,
) -> Callable[[type[AttentionBackend]], type[AttentionBackend]]:
    """Class decorator: makes `get_attention_backend(name)` build this backend."""

    def register(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        _BACKENDS[name] = cls
        return cls

    return register


def get_attention_backend(name: str) -> AttentionBackend:
    """A fresh backend instance; ValueError naming the registered ones if unknown."""
    try:
        return _BACKENDS[name]()
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; registered: {sorted(_BACKENDS)}"
        ) from None


@register_attention_backend("torch")
class TorchAttentionBackend:
    """Vectorized decodes plus one SDPA call per prefill chunk (kernels/torch_paged_attention)."""

    def write_kv(
        self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        torch_kernels.write_kv(kv_cache, k, v, slot_mapping)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        num_decodes = meta.num_decode_tokens
        if meta.num_prefills == 0:
            return torch_kernels.decode_attention(
                q, kv_cache, meta.decode_block_tables, meta.decode_seq_lens, scale, meta.cache
            )
        prefill_out = torch_kernels.prefill_attention(
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
        decode_out = torch_kernels.decode_attention(
            q[:num_decodes],
            kv_cache,
            meta.decode_block_tables,
            meta.decode_seq_lens,
            scale,
            meta.cache,
        )
        return torch.cat((decode_out, prefill_out), dim=0)


class PagedAttention(nn.Module):
    """Per-layer attention over the paged KV cache through a named backend."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, backend: str = "torch"
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.backend = get_attention_backend(backend)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q [T, H, Dh], k / v [T, Hkv, Dh] -> [T, H * Dh]; writes k / v to the cache first."""
        self.backend.write_kv(kv_cache, k, v, meta.slot_mapping)
        out = self.backend.forward(q, k, v, kv_cache, meta, self.scale)
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"backend={type(self.backend).__name__}"
        )
