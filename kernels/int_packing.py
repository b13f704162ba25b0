"""compressed-tensors' packing of small integers into int32 words (`pack_to_int32`):
the layout of a `pack-quantized` checkpoint's `weight_packed` (packed along the inputs)
and `weight_zero_point` (packed along the output channels: pack the transpose).

Semantics, for bits b in (4, 8), k = 32 / b values a word:
    pack_ints(v [R, C] int8 in [-2^(b-1), 2^(b-1) - 1], b) -> int32 [R, ceil(C / k)]:
        value j of each k in bits b j .. b j + b - 1, stored as v + 2^(b-1); a ragged
        last word padded with zeros
    unpack_ints(packed, C, b) is its inverse.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACKED_BITS = (4, 8)


def _check_bits(bits: int) -> int:
    if bits not in PACKED_BITS:
        raise ValueError(f"packed integers are {PACKED_BITS} bits wide, not {bits}")
    return 32 // bits


def pack_ints(values: torch.Tensor, bits: int) -> torch.Tensor:
    """See the module docstring."""
    per_word = _check_bits(bits)
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if values.dtype != torch.int8 or values.dim() != 2:
        raise ValueError("pack_ints takes a 2-D int8 tensor")
    if values.numel() and (int(values.min()) < low or int(values.max()) > high):
        raise ValueError(f"{bits}-bit values must lie in [{low}, {high}]")
    rows, cols = values.shape
    unsigned = F.pad(values.to(torch.int32) - low, (0, -cols % per_word))
    shifts = torch.arange(per_word, dtype=torch.int32) * bits
    return (unsigned.view(rows, -1, per_word) << shifts).sum(dim=2, dtype=torch.int32).contiguous()


def unpack_ints(packed: torch.Tensor, columns: int, bits: int) -> torch.Tensor:
    """int32 [R, ceil(C / k)] -> values [R, C] int8 (`pack_ints`' inverse)."""
    per_word = _check_bits(bits)
    if packed.dtype != torch.int32 or packed.dim() != 2 or packed.shape[1] * per_word < columns:
        raise ValueError(f"need int32 [R, >= {-(-columns // per_word)}] packed {bits}-bit values")
    shifts = torch.arange(per_word, dtype=torch.int32) * bits
    fields = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    values = fields.reshape(packed.shape[0], -1)[:, :columns] - (1 << (bits - 1))
    return values.to(torch.int8).contiguous()
