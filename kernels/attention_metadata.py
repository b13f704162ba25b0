"""Per-step attention metadata: built once by the model runner, read by every layer.

Token layout of one step (the flattened batch the model sees, T tokens in all):

    [ d0 d1 ... d{D-1} | p0 p0 p0 p0 | p1 p1 | ... ]
      decode tokens:     prefill chunks: one chunk per sequence, its
      one per sequence   tokens contiguous and in position order

Decodes come first. A "decode" is a sequence computing exactly one new token; a
"prefill" computes a chunk of q >= 1 tokens whose earlier context (prefix-cache hits
or earlier chunks) already sits in the cache. Every token's K/V is written to
`slot_mapping[t] = block_id * block_size + offset` before attention reads the cache,
so attention always reads keys 0 .. seq_len-1 of a sequence from its block table.

KV cache of one layer: a tensor [2, num_blocks, num_kv_heads, block_size, head_dim]
(index 0 holds K, 1 holds V; head-major inside a block, see torch_paged_attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    block_size: int
    slot_mapping: torch.Tensor
    """[T] int64: cache slot each token's K/V is written to."""
    num_decode_tokens: int
    """D: the first D tokens are decodes, one per sequence."""
    decode_block_tables: torch.Tensor
    """[D, max_blocks] int64 block ids (padding entries are 0 and never read)."""
    decode_seq_lens: torch.Tensor
    """[D] int64: context length of each decode sequence, including its new token."""
    prefill_query_lens: list[int]
    """[P] tokens each prefill sequence computes this step (python ints)."""
    prefill_seq_lens: list[int]
    """[P] context length of each prefill sequence after this step's chunk."""
    prefill_block_tables: torch.Tensor
    """[P, max_blocks] int64 block ids."""
    cache: dict[str, torch.Tensor] = field(default_factory=dict)
    """Scratch space for attention backends: derived tensors computed once per step
    (e.g. gather indices and masks) and reused by every layer."""

    @property
    def num_decodes(self) -> int:
        return self.num_decode_tokens

    @property
    def num_prefills(self) -> int:
        return len(self.prefill_query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])
