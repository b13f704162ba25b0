"""Batched multi-LoRA compute for one projection: every token of a step may use a
different adapter. The torch path lives here; Triton kernels sit in `triton_lora.py`
and the native CPU kernel in `cpu_ops.py`. A kernel backend (backends.py) allocates
the stacks in the layout its path reads and calls its path's `*_add_lora`.

Stacked weights of one projection (`LoRAStack`, written by the adapter slot manager):

    lora_a [L, R, in]    slot l's A; rows past the adapter's rank are zero
    lora_b [L, out, R]   slot l's B, pre-multiplied by the adapter's scaling

L = max_loras slots, R = rank columns. A fused projection with S slices (q/k/v,
gate/up) stacks its slices' A rows (R = S * max_rank) and keeps B block-diagonal:
output rows of slice s only have nonzero columns s * max_rank .. (s + 1) * max_rank.

Token t uses slot token_slots[t]; -1 means the base model (no delta).

Semantics:
    shrink: y[t] = x[t] @ lora_a[s_t].T           x [T, in] -> y [T, R]; y[t] = 0 if s_t = -1
    expand: out[t] += y[t] @ lora_b[s_t].T        y [T, R], out [T, out]; unchanged if s_t = -1
    add_lora = expand(shrink(x)) into out, in place.

The runner orders a step's tokens so equal slots are contiguous; `LoRABatch` then
describes them twice: per token (`token_slots`, read by BGMV kernels for decodes) and
as segments of one slot (read by SGMV kernels for prefill and by the torch path).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loraplex.kernels.cpu_matmul import cpu_lacks_half_matmul, linear


@dataclass(frozen=True)
class LoRABatch:
    """Per-step adapter layout of the flattened batch, built once by the runner.

    `segments` are maximal runs (start, end, slot) of tokens with one slot >= 0, in
    token order, never crossing the boundary between decodes (tokens
    [0, num_decode_tokens), one per sequence) and prefill chunks (the rest); base-model
    tokens belong to none. The `seg_*` tensors describe the prefill segments only
    (what SGMV kernels read); BGMV kernels read `token_slots[:num_decode_tokens]`.
    """

    token_slots: torch.Tensor
    """[T] int64 slot per token, -1 = no adapter."""
    segments: tuple[tuple[int, int, int], ...]
    num_decode_tokens: int
    seg_starts: torch.Tensor
    """[S] int32 first token (absolute index) of each prefill segment."""
    seg_lens: torch.Tensor
    """[S] int32 tokens in each prefill segment."""
    seg_slots: torch.Tensor
    """[S] int32 slot of each prefill segment."""
    max_seg_len: int
    """Longest prefill segment (0 when there is none)."""
    slot_ranks: tuple[int, ...] | None = None
    """Rank of the adapter in each slot, when known: a projection with S slices then
    only has nonzero columns [0, S * rank) in that slot, and the torch path skips the
    rest. None: use every column."""
    slot_rank_tensor: torch.Tensor | None = None
    """`slot_ranks` as an int64 tensor (what the native CPU kernel reads)."""

    @classmethod
    def from_token_slots(
        cls,
        slots: Sequence[int],
        num_decode_tokens: int,
        device: torch.device,
        slot_ranks: Sequence[int] | None = None,
    ) -> LoRABatch:
        """The batch of one slot per token (`from_runs` over its runs of equal slots)."""
        runs: list[tuple[int, int]] = []
        for t, slot in enumerate(slots):
            if runs and runs[-1][0] == slot and t != num_decode_tokens:
                runs[-1] = (slot, runs[-1][1] + 1)
            else:
                runs.append((slot, 1))
        return cls.from_runs(runs, num_decode_tokens, device, slot_ranks)

    @classmethod
    def from_runs(
        cls,
        runs: Sequence[tuple[int, int]],
        num_decode_tokens: int,
        device: torch.device,
        slot_ranks: Sequence[int] | None = None,
    ) -> LoRABatch:
        """The batch of `runs` (slot, token count) in token order: a step's scheduled
        sequences, so the cost follows sequences, not tokens (a prefill of thousands of
        tokens is a few runs)."""
        segments: list[tuple[int, int, int]] = []
        start = 0
        for slot, count in runs:
            end = start + count
            if start < num_decode_tokens < end:
                raise ValueError(f"a run of tokens {start}..{end - 1} crosses the decodes' end")
            if count == 0:
                continue
            merges = (
                segments
                and segments[-1][2] == slot
                and segments[-1][1] == start
                and start != num_decode_tokens
            )
            if merges:
                segments[-1] = (segments[-1][0], end, slot)
            elif slot >= 0:
                segments.append((start, end, slot))
            start = end
        prefill = [seg for seg in segments if seg[0] >= num_decode_tokens]
        as_int32 = functools.partial(torch.tensor, dtype=torch.int32, device=device)
        run_slots = torch.tensor([slot for slot, _ in runs], dtype=torch.int64)
        run_counts = torch.tensor([count for _, count in runs], dtype=torch.int64)
        return cls(
            token_slots=run_slots.repeat_interleave(run_counts).to(device),
            segments=tuple(segments),
            num_decode_tokens=num_decode_tokens,
            seg_starts=as_int32([s for s, _, _ in prefill]),
            seg_lens=as_int32([e - s for s, e, _ in prefill]),
            seg_slots=as_int32([slot for _, _, slot in prefill]),
            max_seg_len=max((e - s for s, e, _ in prefill), default=0),
            slot_ranks=tuple(slot_ranks) if slot_ranks is not None else None,
            slot_rank_tensor=(
                torch.tensor(list(slot_ranks), dtype=torch.int64, device=device)
                if slot_ranks is not None
                else None
            ),
        )

    @property
    def empty(self) -> bool:
        return not self.segments


@dataclass(frozen=True)
class PendingExpand:
    """A projection's LoRA expand left to the kernel that consumes its output (after a
    folded shrink, platform/layers/linear.py `forward_deferred`): that kernel adds

        out[t] += shrunk[t, s_t] @ b[s_t].T    for each token t with s_t = token_slots[t] >= 0

    before its own work, rounding the sum to out's dtype once, as the expand kernel
    would have."""

    shrunk: torch.Tensor
    """[T, L, R] every slot's shrink of every token (any strides)."""
    b: torch.Tensor
    """[L, N, R] the slots' B, pre-multiplied by their scaling."""
    token_slots: torch.Tensor
    """[T] int64 slot per token, -1 = no adapter."""

    def apply(self, out: torch.Tensor) -> torch.Tensor:
        """out + the delta in plain torch (the reference of the fused kernels)."""
        slots = self.token_slots
        rows = torch.arange(out.shape[0], device=out.device)
        used = slots.clamp(min=0)
        y = self.shrunk[rows, used].float() * (slots >= 0)[:, None]
        delta = torch.einsum("tr,tnr->tn", y, self.b[used].float())
        return (out.float() + delta).to(out.dtype)


@dataclass(frozen=True)
class LoRAStack:
    """Slot-stacked adapter weights of one projection (allocated by the kernel backend,
    written by the adapter slot manager). A fused projection with S slices packs slot
    l's adapter of rank r as

        a[l, s*r : s*r + r_s, :]                      = A_s    (r_s <= r: slice s's rank)
        b[l, off_s : off_s + out_s, s*r : s*r + r_s]  = B_s * scaling

    so the first S * r columns of a slot carry everything (the torch path reads only
    those)."""

    a: torch.Tensor
    """[max_loras, num_slices * max_rank, in_features]"""
    b: torch.Tensor
    """[max_loras, out_features, num_slices * max_rank]; on the 'cpu' backend a view of
    rank-major storage [max_loras, width, out_features] (each column B[l, :, r] is
    contiguous, as the native kernel reads it)."""
    slice_ends: tuple[int, ...]
    """Where each output slice ends (the last: out_features): B's zero blocks."""

    @property
    def num_slices(self) -> int:
        return len(self.slice_ends)

    @property
    def num_bytes(self) -> int:
        return self.a.numel() * self.a.element_size() + self.b.numel() * self.b.element_size()


def torch_add_lora(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    batch: LoRABatch,
    num_slices: int = 1,
) -> None:
    """Plain torch path: segment-grouped matmuls (SGMV in plain torch) for every token.
    Decodes are segments too, since the runner sorts them by slot."""
    segment_matmuls(out, x, lora_a, lora_b, batch.segments, batch.slot_ranks, num_slices)


def cpu_add_lora(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    batch: LoRABatch,
    slice_ends: Sequence[int] | None = None,
) -> None:
    """Native CPU path (kernels/cpu_ops.py `lora_add`) for decodes and prefill chunks:
    fp32 slots, rank-major B, the delta added into `out` in place. Against the torch
    path it skips the per-group call overhead of a few decode rows per adapter and, for
    half models, the fp32 copies of x and the delta; for a fused projection
    (`slice_ends`, default one slice) the zero blocks of B."""
    from loraplex.kernels import cpu_ops

    ends = slice_ends if slice_ends is not None else (out.size(1),)
    cpu_ops.lora_add(out, x, lora_a, lora_b, batch.token_slots, batch.slot_rank_tensor, ends)


def segment_matmuls(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    segments: tuple[tuple[int, int, int], ...],
    ranks: tuple[int, ...] | None,
    num_slices: int,
) -> None:
    """out += delta over `segments` (start, end, slot) with plain torch matmuls.

    Adjacent segments of equal length and width (round-robin decodes, equal prefill
    chunks) run as one batched shrink and one batched expand; a lone segment as two
    matmuls. With `ranks`, only a slot's first num_slices * rank columns are read. The
    stacks may be wider than x (fp32 slots for a bf16 model): x is widened and the
    delta rounded once, when it is added."""
    width = lora_a.shape[1]
    for group in _adjacent_equal_segments(segments, ranks, num_slices, width):
        first, last = group[0], group[-1]
        used = _used_width(first[2], ranks, num_slices, width)
        length = first[1] - first[0]
        tokens = slice(first[0], last[1])
        x_group = x[tokens].to(lora_a.dtype)
        accumulate = out.dtype == lora_b.dtype and not _lacks_half_matmul(out)
        if len(group) == 1:
            y = _matmul_t(x_group, lora_a[first[2], :used])
            b = lora_b[first[2], :, :used]
            if accumulate:
                out[tokens].addmm_(y, b.T)
                continue
            delta = _matmul_t(y, b)
        else:
            a, b = _group_weights(lora_a, lora_b, [slot for _, _, slot in group], used)
            x_batched = x_group.reshape(len(group), length, -1)
            y = torch.bmm(x_batched, a.transpose(1, 2))
            if accumulate:
                # The expand adds into `out` in place: no [tokens, out] delta to write
                # and read back (the prefill expand is memory-bound).
                out[tokens].view(len(group), length, -1).baddbmm_(y, b.transpose(1, 2))
                continue
            delta = torch.bmm(y, b.transpose(1, 2)).flatten(0, 1)
        out[tokens] += delta.to(out.dtype)


def _group_weights(
    lora_a: torch.Tensor, lora_b: torch.Tensor, slots: list[int], used: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A [n, used, in] and B [n, out, used] of `slots`: views when the slots are
    consecutive (the usual case, decodes being sorted by slot), else gathered copies."""
    if slots == list(range(slots[0], slots[0] + len(slots))):
        rows = slice(slots[0], slots[0] + len(slots))
        return lora_a[rows, :used], lora_b[rows, :, :used]
    index = torch.tensor(slots, device=lora_a.device)
    return lora_a.index_select(0, index)[:, :used], lora_b.index_select(0, index)[:, :, :used]


def _used_width(slot: int, ranks: tuple[int, ...] | None, num_slices: int, width: int) -> int:
    return min(width, num_slices * ranks[slot]) if ranks is not None else width


def _adjacent_equal_segments(
    segments: tuple[tuple[int, int, int], ...],
    ranks: tuple[int, ...] | None,
    num_slices: int,
    width: int,
) -> list[list[tuple[int, int, int]]]:
    """Segments grouped into runs that touch end to start and share length and width."""
    groups: list[list[tuple[int, int, int]]] = []
    for segment in segments:
        if groups:
            previous = groups[-1][-1]
            if (
                previous[1] == segment[0]
                and previous[1] - previous[0] == segment[1] - segment[0]
                and _used_width(previous[2], ranks, num_slices, width)
                == _used_width(segment[2], ranks, num_slices, width)
            ):
                groups[-1].append(segment)
                continue
        groups.append([segment])
    return groups


def _lacks_half_matmul(out: torch.Tensor) -> bool:
    return out.device.type == "cpu" and cpu_lacks_half_matmul(out.dtype)


def _matmul_t(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T, with the projections' fp32 widening on CPUs lacking half matmul."""
    return linear(x, weight, None)


def triton_add_lora(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    batch: LoRABatch,
    num_slices: int = 1,
) -> None:
    """GPU path: BGMV kernels for the decode tokens, SGMV kernels for prefill chunks;
    the shrink output is fp32. Reads every column (`num_slices` is not needed). A batch
    of segments alone with few tokens and few slot columns (a decode graph's step past
    `max_loras` decodes) shrinks for every slot in one matmul (`_dense_shrink_fits`)."""
    from loraplex.kernels import triton_lora

    decodes = batch.num_decode_tokens
    if not decodes and batch.max_seg_len and _dense_shrink_fits(x, lora_a):
        y = triton_lora.dense_shrink(x, lora_a)
        segs = (batch.seg_starts, batch.seg_lens, batch.seg_slots, batch.max_seg_len)
        triton_lora.sgmv_expand(y, lora_b, *segs, out)
        return
    # Rows outside every segment and slot -1 rows are never read back: no memset.
    y = torch.empty(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    if decodes:
        triton_lora.bgmv_shrink(x[:decodes], lora_a, batch.token_slots[:decodes], y[:decodes])
        triton_lora.bgmv_expand(y[:decodes], lora_b, batch.token_slots[:decodes], out[:decodes])
    if batch.max_seg_len:
        segs = (batch.seg_starts, batch.seg_lens, batch.seg_slots, batch.max_seg_len)
        triton_lora.sgmv_shrink(x, lora_a, *segs, y)
        triton_lora.sgmv_expand(y, lora_b, *segs, out)


DENSE_SHRINK_MAX_TOKENS = 256
DENSE_SHRINK_MAX_COLUMNS = 512
"""Bounds of the dense shrink: it computes every slot's columns for every token, so its
reads grow with L * R (all slots' A, used or not) and its work with tokens x L * R. Up
to 256 tokens and 512 stacked columns (8 slots of a rank-16 q/k/v) it reads no more
than the SGMV shrink with every slot in use."""


def _dense_shrink_fits(x: torch.Tensor, lora_a: torch.Tensor) -> bool:
    return x.shape[0] <= DENSE_SHRINK_MAX_TOKENS and foldable_shrink(lora_a)


def foldable_shrink(lora_a: torch.Tensor) -> bool:
    """Whether every slot's shrink may be computed for every token (a dense shrink, or
    the slots' A rows appended to the projection's weight): at most
    `DENSE_SHRINK_MAX_COLUMNS` stacked columns, in one contiguous block."""
    slots, rank, _ = lora_a.shape
    return slots * rank <= DENSE_SHRINK_MAX_COLUMNS and lora_a.is_contiguous()


def triton_expand_folded(
    out: torch.Tensor, shrunk: torch.Tensor, lora_b: torch.Tensor, batch: LoRABatch
) -> None:
    """GPU path after a folded shrink (platform/layers/linear.py `fold_lora_shrink`): the
    projection's one matmul over its weight with every slot's A rows appended gave the
    base output `out` and `shrunk`, every slot's shrink of every token; each token of a
    segment adds its own slot's expand.

    Semantics: out[t] += shrunk[t, s_t] @ lora_b[s_t].T for every token t of every
    segment (slot s_t); other rows untouched. out [T, N] (rows may be strided),
    shrunk [T, L, R] in out's dtype, lora_b [L, N, R]. Only for a batch with no BGMV
    decode tokens (`batch.num_decode_tokens == 0`: prefill steps, and a decode graph's
    segment table)."""
    from loraplex.kernels import triton_lora

    if batch.num_decode_tokens:
        raise ValueError("a folded shrink serves segments only, not BGMV decode tokens")
    if batch.max_seg_len:
        segs = (batch.seg_starts, batch.seg_lens, batch.seg_slots, batch.max_seg_len)
        triton_lora.sgmv_expand(shrunk, lora_b, *segs, out)
