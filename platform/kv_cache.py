"""The KV cache tensors of one rank: how many blocks fit, allocate them, copy blocks.

One tensor per layer, [2, num_blocks, num_kv_heads, block_size, head_dim]: index 0 holds
K, 1 holds V, and token p of a sequence whose block table is `table` lives at block
`table[p // block_size]`, offset `p % block_size` (see kernels/paged_attention.py).
Which blocks belong to which request is decided elsewhere (kv_cache_manager.py).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from loraplex.platform.arch import ModelArch
from loraplex.platform.config import CacheConfig


def allocate_kv_caches(
    arch: ModelArch,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    num_kv_heads: int | None = None,
) -> list[torch.Tensor]:
    """One zeroed [2, num_blocks, num_kv_heads, block_size, head_dim] tensor per layer
    (zeros, so padded reads of never-written slots stay finite); `num_kv_heads`
    overrides the model's count with a tensor-parallel rank's share."""
    heads = arch.num_kv_heads if num_kv_heads is None else num_kv_heads
    shape = (2, num_blocks, heads, block_size, arch.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.num_layers)]


def copy_blocks(kv_caches: list[torch.Tensor], copies: Sequence[tuple[int, int]]) -> None:
    """Copy-on-write: block dst <- block src in every layer's cache, for (src, dst) pairs."""
    if not copies:
        return
    device = kv_caches[0].device
    src = torch.tensor([s for s, _ in copies], device=device)
    dst = torch.tensor([d for _, d in copies], device=device)
    for cache in kv_caches:
        cache[:, dst] = cache[:, src]


def device_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def plan_num_blocks(
    cache: CacheConfig,
    arch: ModelArch,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    num_kv_heads: int | None = None,
    reserved_bytes: int = 0,
) -> int:
    """Number of KV blocks the memory budget buys (per rank: with `num_kv_heads` of the
    model's kv heads); a budget given as a fraction of the device first leaves out
    `reserved_bytes` (the decode graphs' memory pool), one given in bytes is the KV
    cache's alone. Fails if one max_model_len sequence would not fit,
    naming the numbers."""
    bytes_per_block = arch.kv_bytes_per_token(dtype, num_kv_heads) * cache.block_size
    if cache.num_blocks_override is not None:
        num_blocks = cache.num_blocks_override
        budget = num_blocks * bytes_per_block
    else:
        budget = cache.kv_cache_memory_bytes or max(
            0, int(cache.kv_cache_memory_fraction * device_memory_bytes(device)) - reserved_bytes
        )
        num_blocks = budget // bytes_per_block
    needed = -(-max_model_len // cache.block_size)
    if num_blocks < needed:
        raise ValueError(
            f"KV cache budget too small: {budget} bytes buys {num_blocks} blocks of "
            f"{cache.block_size} tokens ({bytes_per_block} bytes each), but one "
            f"max_model_len={max_model_len} sequence needs {needed} blocks "
            f"({needed * bytes_per_block} bytes). Raise the KV budget or lower max_model_len."
        )
    return num_blocks
