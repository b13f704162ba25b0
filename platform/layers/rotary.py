"""Rotary position embedding (neox half-split layout) with HF-exact inverse frequencies."""

from __future__ import annotations

import math

import torch
from torch import nn

from loraplex.platform.arch import RopeConfig

_INITIAL_POSITIONS = 8192
"""Positions cached up front; the cache doubles on demand past that."""


def compute_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, computed as transformers does.

    default: theta ** -(2i / head_dim); linear: default / factor; llama3: low frequencies
    divided by `factor`, high ones kept, the band between interpolated smoothly.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_context = rope.original_max_position_embeddings
    low_freq_wavelen = old_context / rope.low_freq_factor
    high_freq_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Caches cos/sin per position in fp32; the model looks them up once per step.

    The cache covers min(max_positions, 8192) positions at first and grows when a
    step asks for a later position (e.g. max_model_len above the model's limit). Once
    the engine has called `cover(max_model_len)`, no step asks for a position past the
    cache, and `cos_sin` stops checking (the check reads the positions back to the host:
    a device sync per step on a GPU, and not allowed inside a CUDA graph capture).

    Semantics: for x [T, heads, Dh] with halves x1 = x[..., :Dh/2], x2 = x[..., Dh/2:]
    and angles a = position * inv_freq [T, Dh/2]:
        out = cat(x1 * cos(a) - x2 * sin(a), x2 * cos(a) + x1 * sin(a))
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        rope: RopeConfig,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        inv_freq = compute_inv_freq(head_dim, rope).to(device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._covered = False
        self._build(min(max_positions, _INITIAL_POSITIONS))

    def cover(self, num_positions: int) -> None:
        """Caches positions 0 .. num_positions - 1 now; the caller promises that no later
        step asks for a position past them."""
        if num_positions > self.cos_cache.shape[0]:
            self._build(num_positions)
        self._covered = True

    def _build(self, num_positions: int) -> None:
        positions = torch.arange(num_positions, dtype=torch.float32, device=self.inv_freq.device)
        angles = positions[:, None] * self.inv_freq[None, :]
        self.register_buffer("cos_cache", angles.cos(), persistent=False)
        self.register_buffer("sin_cache", angles.sin(), persistent=False)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin), each [T, 1, Dh/2] in `dtype`, broadcastable over heads."""
        if (
            not self._covered
            and positions.numel()
            and int(positions.max()) >= self.cos_cache.shape[0]
        ):
            self._build(2 * int(positions.max()) + 1)
        cos = self.cos_cache.index_select(0, positions).to(dtype)
        sin = self.sin_cache.index_select(0, positions).to(dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)
