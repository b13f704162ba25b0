"""Attention front-end: rotates q / k, writes the step's K/V into the paged cache, then
attends, all through the engine's kernel backend (kernels/backends.py)."""

from __future__ import annotations

import torch
from torch import nn

from loraplex.kernels.attention_metadata import AttentionMetadata
from loraplex.kernels.backends import get_backend


class PagedAttention(nn.Module):
    """Per-layer attention over the paged KV cache through a named kernel backend."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, kernels: str = "torch"
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.kernels = get_backend(kernels)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q [T, H, Dh], k / v [T, Hkv, Dh] (before rotary), cos / sin [T, 1, Dh/2]
        -> [T, H * Dh]."""
        q, k = self.kernels.rotary_write_kv(q, k, v, cos, sin, kv_cache, meta.slot_mapping)
        out = self.kernels.attention(q, k, v, kv_cache, meta, self.scale)
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"kernels={type(self.kernels).__name__}"
        )
