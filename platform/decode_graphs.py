"""CUDA graphs for decode-only steps: one captured forward per batch-size bucket.

A decode step on a GPU is dozens of small kernels per layer; launched one by one from
Python, the GPU waits on the host (about 0.35 ms per layer on an H200 whatever the
width). Captured once, a whole step (embedding, every layer's projections, paged
attention, LoRA BGMV, final norm and LM head) replays in one launch.

Static inputs, one set for every bucket (the graphs read their first B rows):

    rows   [5, M] int64    token ids | positions | cache slots | context lengths |
                           adapter slots (-1: base model)
    tables [M, W] int64    block table of each sequence, W = ceil(max_model_len / block)

M is the largest bucket. A step of D decodes runs the smallest bucket B >= D: its
inputs go into a pinned host copy of `rows` and `tables`, then to the device in two
asynchronous copies, and rows D .. B - 1 are padding (token 0 at position 0, cache slot
-1 so nothing is written, context length 1, no adapter; their logits are dropped).
Table entries past a sequence's own blocks may hold stale block ids: attention reads
only a sequence's first `context length` keys, so they are never used.

Each bucket has a base graph and, with LoRA on, a graph with the LoRA kernels in it
(the slot weights are written in place, so a graph sees every adapter loaded after it
was captured). A step whose sequences all run the base model replays the base graph
and pays no LoRA kernel. Decodes are ordered by adapter slot (model_runner.py), so
each adapter's decodes are one run of rows. On the Triton kernels a bucket of at most
`max_loras` decodes reads each token's adapter slot from `rows` (BGMV: every token
reads its adapter's weights); a larger bucket, and every bucket where the projections
fold the LoRA shrink into their weights (`folded_shrink`, layers/linear.py: the shrink
then costs no kernel), reads a static segment table

    segments [3, max_loras] int32    first row | rows | slot of each adapter's run
                                     (unused entries: 0 rows, slot -1)

(SGMV: each adapter's weights are read once per tile of its rows, not once per token;
at 64 decodes over 8 adapters, 8 reads of each weight instead of 64).

Semantics: `run(step)` returns float32 logits [D, V] equal to the eager forward's
`compute_logits(model(...))` over the same decodes (the same kernels run in the same
order, so the values are identical). Before `capture()`, or off the GPU, `run` runs
the same padded forward over the same buffers eagerly (what the CPU tests check).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from loraplex.kernels.attention_metadata import AttentionMetadata
from loraplex.kernels.lora import LoRABatch

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
"""Captured batch sizes (those up to the engine's max_num_seqs, and it)."""

_IDS, _POSITIONS, _SLOTS, _LENS, _ADAPTERS = range(5)
_PADDING = (0, 0, -1, 1, -1)
"""Row values of a padding decode (see the module docstring)."""


DecodeForward = Callable[
    [torch.Tensor, torch.Tensor, AttentionMetadata, LoRABatch | None], torch.Tensor
]
"""(token ids [B], positions [B], attention metadata, LoRA batch) -> logits [B, V]."""


@dataclass(frozen=True)
class DecodeStep:
    """D decodes, in the order their logits come back."""

    token_ids: list[int]
    positions: list[int]
    cache_slots: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    adapter_slots: list[int] | None
    """Per decode its adapter's device slot, -1 for the base model; None: no adapter."""

    @property
    def num_decodes(self) -> int:
        return len(self.token_ids)


def buckets_up_to(max_batch: int) -> tuple[int, ...]:
    """The captured batch sizes for at most `max_batch` decodes per step."""
    return tuple(b for b in BUCKETS if b < max_batch) + (max_batch,)


def graph_memory_estimate(
    hidden_size: int,
    intermediate_size: int,
    vocab_size: int,
    dtype: torch.dtype,
    max_batch: int,
) -> int:
    """Bytes the graphs' shared memory pool may take: the largest bucket's activations
    (a few hidden-sized tensors, the gate/up output, float32 logits) with room to spare;
    the engine takes it out of the KV cache budget."""
    width = torch.empty((), dtype=dtype).element_size()
    per_row = width * (8 * hidden_size + 3 * intermediate_size) + 8 * vocab_size
    return 2 * max_batch * per_row + (16 << 20)


class DecodeGraphs:
    """Captured decode forwards of one model over its KV cache (see the module docstring)."""

    def __init__(
        self,
        decode_logits: DecodeForward,
        device: torch.device,
        block_size: int,
        max_model_len: int,
        max_batch: int,
        max_loras: int,
        kernels: str,
        folded_shrink: bool = False,
    ) -> None:
        """`decode_logits`: the runner's decode forward (`ModelRunner.decode_logits`);
        `max_loras`: the engine's adapter slots (0: LoRA off, no LoRA graphs);
        `kernels`: the kernel backend's name (segment tables on 'triton' only);
        `folded_shrink`: the model's projections fold the LoRA shrink
        (`layers.linear.has_folded_projections`), so every bucket reads the segment table."""
        self.decode_logits = decode_logits
        self.block_size = block_size
        self.device = device
        self.buckets = buckets_up_to(max_batch)
        self.with_lora = max_loras > 0
        self.max_loras = max_loras
        self.kernels = kernels
        self.folded_shrink = folded_shrink
        largest = self.buckets[-1]
        width = -(-max_model_len // block_size)
        self._rows = torch.zeros(5, largest, dtype=torch.int64, device=self.device)
        self._tables = torch.zeros(largest, width, dtype=torch.int64, device=self.device)
        segments = max(max_loras, 1)
        self._segments = torch.zeros(3, segments, dtype=torch.int32, device=self.device)
        pinned = self.device.type == "cuda"
        self._host_rows = torch.zeros(5, largest, dtype=torch.int64, pin_memory=pinned)
        self._host_tables = torch.zeros(largest, width, dtype=torch.int64, pin_memory=pinned)
        self._host_segments = torch.zeros(3, segments, dtype=torch.int32, pin_memory=pinned)
        self._graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool_bytes = 0

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    @property
    def max_blocks(self) -> int:
        return self._tables.shape[1]

    def capture(self) -> float:
        """Captures every bucket (largest first, all in one memory pool); returns the
        seconds it took."""
        started = time.monotonic()
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        pool = torch.cuda.graph_pool_handle()
        for batch in reversed(self.buckets):
            for lora in (False, True) if self.with_lora else (False,):
                self._graphs[(batch, lora)] = self._capture_one(batch, lora, pool)
        torch.cuda.synchronize(self.device)
        self.pool_bytes = torch.cuda.memory_allocated(self.device) - before
        elapsed = time.monotonic() - started
        logger.info(
            "CUDA graphs captured in %.1fs: %d decode batch sizes up to %d%s, %.1f MiB",
            elapsed,
            len(self.buckets),
            self.max_batch,
            " (base and LoRA)" if self.with_lora else "",
            self.pool_bytes / 2**20,
        )
        return elapsed

    def _forward(self, batch: int, lora: bool) -> torch.Tensor:
        rows = self._rows
        meta = AttentionMetadata(
            block_size=self.block_size,
            slot_mapping=rows[_SLOTS, :batch],
            num_decode_tokens=batch,
            decode_block_tables=self._tables[:batch],
            decode_seq_lens=rows[_LENS, :batch],
            prefill_query_lens=[],
            prefill_seq_lens=[],
            prefill_block_tables=self._tables[:0],
        )
        lora_batch = self._lora_batch(batch) if lora else None
        return self.decode_logits(rows[_IDS, :batch], rows[_POSITIONS, :batch], meta, lora_batch)

    def _uses_segments(self, batch: int) -> bool:
        """SGMV over the segment table for this bucket (else BGMV per token). The table
        holds `max_loras` runs, as many as a step's decodes can use."""
        return self.kernels == "triton" and (batch > self.max_loras or self.folded_shrink)

    def _lora_batch(self, batch: int) -> LoRABatch:
        """The LoRABatch a bucket's graph reads: its slots per token (BGMV), or on the
        Triton kernels past `max_loras` decodes the segment table (SGMV; no token
        counts as a decode, so no BGMV kernel runs). One nominal segment keeps it
        non-empty."""
        token_slots = self._rows[_ADAPTERS, :batch]
        segments = self._segments
        if self._uses_segments(batch):
            return LoRABatch(
                token_slots=token_slots,
                segments=((0, batch, 0),),
                num_decode_tokens=0,
                seg_starts=segments[0],
                seg_lens=segments[1],
                seg_slots=segments[2],
                max_seg_len=batch,
            )
        return LoRABatch(
            token_slots=token_slots,
            segments=((0, batch, 0),),
            num_decode_tokens=batch,
            seg_starts=segments[0, :0],
            seg_lens=segments[1, :0],
            seg_slots=segments[2, :0],
            max_seg_len=0,
        )

    def _write_segments(self, adapter_slots: list[int]) -> None:
        """The segment table of `adapter_slots` (ordered by slot): one entry per run of
        rows with one adapter, the rest empty."""
        starts, lens, slots = [], [], []
        row = 0
        while row < len(adapter_slots):
            end = row
            while end < len(adapter_slots) and adapter_slots[end] == adapter_slots[row]:
                end += 1
            if adapter_slots[row] >= 0:
                starts.append(row)
                lens.append(end - row)
                slots.append(adapter_slots[row])
            row = end
        unused = self._segments.shape[1] - len(starts)
        if unused < 0:
            raise ValueError(
                f"{len(starts)} adapters in one step; the table holds {self._segments.shape[1]}"
            )
        table = [*starts, *[0] * unused, *lens, *[0] * unused, *slots, *[-1] * unused]
        self._host_segments.copy_(torch.tensor(table, dtype=torch.int32).view(3, -1))
        self._segments.copy_(self._host_segments, non_blocking=True)

    def _capture_one(
        self, batch: int, lora: bool, pool: tuple[int, int]
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        self._write_padding(batch)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # compiles the Triton kernels, settles the allocator
                self._forward(batch, lora)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self._forward(batch, lora)
        return graph, logits

    def _write_padding(self, batch: int) -> None:
        for row, value in enumerate(_PADDING):
            self._rows[row, :batch].fill_(value)
        self._segments[:2].zero_()
        self._segments[2].fill_(-1)

    def bucket_for(self, num_decodes: int) -> int | None:
        """The smallest captured batch size >= num_decodes (None: more than any)."""
        for batch in self.buckets:
            if batch >= num_decodes:
                return batch
        return None

    def run(self, step: DecodeStep) -> torch.Tensor:
        """Replays the bucket of `step` over its inputs: float32 logits [D, V]."""
        count = step.num_decodes
        batch = self.bucket_for(count)
        if batch is None or count == 0:
            raise ValueError(f"{count} decodes: the captured batch sizes are {self.buckets}")
        lora = step.adapter_slots is not None and any(s >= 0 for s in step.adapter_slots)
        if lora and not self.with_lora:
            raise ValueError("a decode uses an adapter, but no LoRA graph was captured")
        pad = batch - count
        adapters = step.adapter_slots if step.adapter_slots is not None else [-1] * count
        flat = [
            *step.token_ids, *[_PADDING[_IDS]] * pad,
            *step.positions, *[_PADDING[_POSITIONS]] * pad,
            *step.cache_slots, *[_PADDING[_SLOTS]] * pad,
            *step.context_lens, *[_PADDING[_LENS]] * pad,
            *adapters, *[_PADDING[_ADAPTERS]] * pad,
        ]  # fmt: skip
        host_rows = self._host_rows[:, :batch]
        host_rows.copy_(torch.tensor(flat, dtype=torch.int64).view(5, batch))
        self._rows[:, :batch].copy_(host_rows, non_blocking=True)
        width = max(len(table) for table in step.block_tables)
        if width > self.max_blocks:
            raise ValueError(f"a block table of {width} blocks; the graphs hold {self.max_blocks}")
        padded = [table + [0] * (width - len(table)) for table in step.block_tables]
        host_tables = self._host_tables[:count, :width]
        host_tables.copy_(torch.tensor(padded, dtype=torch.int64))
        self._tables[:count, :width].copy_(host_tables, non_blocking=True)
        if lora and self._uses_segments(batch):
            self._write_segments(adapters)
        captured = self._graphs.get((batch, lora))
        if captured is None:  # not captured (off the GPU): the same forward, eagerly
            return self._forward(batch, lora)[:count]
        graph, logits = captured
        graph.replay()
        return logits[:count]
