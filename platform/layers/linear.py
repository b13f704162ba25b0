"""Projection layers: one weight holding one or more stacked output slices.

Fused projections (q/k/v, gate/up) are one matmul on CPU; `output_sizes` records
each slice. With LoRA enabled a projection also holds a `LoRAStack` (its slots'
adapter weights, in its kernel backend's layout) and adds each token's adapter delta
after the base matmul through that backend. Where the backend folds the shrink
(`fold_lora_shrink`), the slots' A rows live right after the weight's rows in one
tensor, and a step of adapter segments computes the base output and every slot's
shrink in one matmul.
Parameters are allocated uninitialized: every value comes from the checkpoint.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from loraplex.kernels.backends import KernelBackend
from loraplex.kernels.cpu_matmul import PackedWeight, linear
from loraplex.kernels.int4_matmul import Int4Weight, group_count, unpack_int4
from loraplex.kernels.int8_matmul import Int8Weight
from loraplex.kernels.int_packing import unpack_ints
from loraplex.kernels.lora import LoRABatch, LoRAStack, PendingExpand
from loraplex.platform.parallel.group import TPGroup


class MergedLinear(nn.Module):
    """y = x @ W.T + b with W = cat(W_0, W_1, ...) along the output dimension.

    Shapes: x [T, in_features] -> y [T, sum(output_sizes)]; slice i of y is
    y[:, offsets[i]:offsets[i] + output_sizes[i]].

    Column-parallel under tensor parallelism: slice i holds rows
    `row_ranges[i] = (start, size)` of the checkpoint's tensor i (default: all of them),
    so `output_sizes` are this rank's sizes. Its LoRA slots keep A whole and B's rows
    of the same ranges, so each rank computes its own output columns exactly.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        bias: bool,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        row_ranges: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.full_sizes = tuple(int(n) for n in output_sizes)
        """Each slice's row count in the checkpoint (all ranks together)."""
        if row_ranges is None:
            row_ranges = [(0, n) for n in self.full_sizes]
        self.row_ranges = tuple((int(a), int(n)) for a, n in row_ranges)
        if len(self.row_ranges) != len(output_sizes):
            raise ValueError(f"{len(output_sizes)} slices but {len(self.row_ranges)} row ranges")
        self.output_sizes = tuple(n for _, n in self.row_ranges)
        self.out_features = sum(self.output_sizes)
        shape = (self.out_features, in_features)
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
        self.bias = (
            nn.Parameter(torch.empty(self.out_features, dtype=dtype, device=device))
            if bias
            else None
        )
        self.lora: LoRAStack | None = None
        self.lora_kernels: KernelBackend | None = None
        """The backend that allocated `lora` and adds its deltas."""
        self.lora_fold: torch.Tensor | None = None
        """[out_features + L * R, in_features]: `weight` as its first rows, every slot's
        A (`lora.a`, [L, R, in]) as the rest, when the shrink is folded."""
        self.packed: PackedWeight | Int8Weight | Int4Weight | None = None
        """oneDNN copy of `weight` (CPU), made by `pack` once the weights are loaded, or
        its int8 form (`quantize`, or an int8 checkpoint's: `finish_int8_load`), or an
        int4 checkpoint's (`finish_int4_load`)."""
        self.int8_weight: torch.Tensor | None = None
        self.int8_packed: torch.Tensor | None = None
        self.int8_scale: torch.Tensor | None = None
        self.int4_packed: torch.Tensor | None = None
        self.int4_scale: torch.Tensor | None = None
        self.int4_zero: torch.Tensor | None = None
        self.int4_group_size = 0

    @property
    def offsets(self) -> tuple[int, ...]:
        """Start row of each output slice in `weight`."""
        starts = [0]
        for size in self.output_sizes[:-1]:
            starts.append(starts[-1] + size)
        return tuple(starts)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        """x [T, in] -> [T, out]; adds each token's adapter delta when `lora` is given
        (rows strided by the folded width when the shrink is folded)."""
        if self._folds(lora):
            return self._folded_forward(x, lora)
        out = self._matmul(x, self.bias)
        self._add_lora(out, x, lora)
        return out

    def _folds(self, lora: LoRABatch | None) -> bool:
        return (
            lora is not None
            and self.lora_fold is not None
            and self.lora_kernels.uses_folded_shrink(lora)
        )

    def forward_deferred(
        self, x: torch.Tensor, lora: LoRABatch | None = None
    ) -> tuple[torch.Tensor, PendingExpand | None]:
        """`forward`, except that a step whose shrink is folded leaves its expand to the
        kernel consuming the output (an RMSNorm's, `RMSNorm.forward`): (the output
        without its adapter deltas, the pending expand); else (`forward`, None)."""
        if not self._folds(lora):
            return self.forward(x, lora), None
        out, shrunk = self._folded_matmul(x)
        return out, PendingExpand(shrunk, self.lora.b, lora.token_slots)

    def _folded_forward(self, x: torch.Tensor, lora: LoRABatch) -> torch.Tensor:
        """`_folded_matmul`, then each token's expand of its own slot's columns."""
        out, shrunk = self._folded_matmul(x)
        self.lora_kernels.expand_folded(out, shrunk, self.lora, lora)
        return out

    def _folded_matmul(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[x @ W.T | x @ A_l.T for every slot l] in one matmul: (the base output
        [T, out] and every slot's shrink [T, L, R], both views of it)."""
        both = linear(x, self.lora_fold, None)
        slots, width, _ = self.lora.a.shape
        shrunk = both[:, self.out_features :].view(-1, slots, width)
        return both[:, : self.out_features], shrunk

    def _add_lora(self, out: torch.Tensor, x: torch.Tensor, lora: LoRABatch | None) -> None:
        if lora is not None and self.lora is not None:
            self.lora_kernels.add_lora(out, x, self.lora, lora)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x, bias)
        return linear(x, self.weight, bias)

    def pack(self) -> None:
        """Prepacks the loaded weight for oneDNN where that is faster (CPU only)."""
        self.packed = PackedWeight.maybe(self.weight)

    @torch.no_grad()
    def quantize(self, mode: str, native: bool, input_gain: torch.Tensor | None = None) -> None:
        """Replaces the loaded weight by its int8 form (kernels/int8_matmul.py, CPU;
        `native`: with the native CPU ops; `input_gain`: the smoothing of the RMSNorm
        before it, dynamic mode); `weight` keeps its dtype and device, and no values."""
        if self.weight.device.type != "cpu":
            raise ValueError(f"int8 projections run on a CPU, not {self.weight.device}")
        self.packed = Int8Weight.from_float(self.weight, mode, native, input_gain)
        self.weight.data = self.weight.new_empty(0)

    def prepare_int8_load(self, packed: bool = False) -> None:
        """Makes room for an int8 checkpoint's weight and per-channel scales (loaded by
        `load_slice` as 'int8_weight', or 'int8_packed' where four values are packed to
        an int32, and 'int8_scale'); `weight` keeps no values."""
        device = self.weight.device
        if packed:
            words = -(-self.in_features // 4)
            self.int8_packed = torch.empty(
                self.out_features, words, dtype=torch.int32, device=device
            )
        else:
            self.int8_weight = torch.empty(
                self.out_features, self.in_features, dtype=torch.int8, device=device
            )
        self.int8_scale = torch.empty(self.out_features, dtype=torch.float32, device=device)
        self.weight.data = self.weight.new_empty(0)

    def finish_int8_load(self, mode: str, native: bool) -> None:
        """The loaded int8 weight and scales become the projection's product, as stored
        (kernels/int8_matmul.py, CPU)."""
        if self.int8_scale.device.type != "cpu":
            raise ValueError(f"int8 projections run on a CPU, not {self.int8_scale.device}")
        if self.int8_packed is not None:
            self.int8_weight = unpack_ints(self.int8_packed, self.in_features, 8)
        self.packed = Int8Weight(self.int8_weight, self.int8_scale, mode, native)
        self.int8_weight = self.int8_packed = self.int8_scale = None

    def prepare_int4_load(self, group_size: int | None, symmetric: bool) -> None:
        """Makes room for an int4 checkpoint's packed weight, scales and (unless
        `symmetric`) zero points, `group_size` inputs a group (None: one per output
        channel), loaded by `load_slice` as 'int4_packed', 'int4_scale', 'int4_zero'
        (kernels/int4_matmul.py); `weight` keeps no values."""
        size = group_size or self.in_features
        groups = group_count(self.in_features, size)
        device = self.weight.device
        rows, words = self.out_features, -(-self.in_features // 8)
        self.int4_packed = torch.empty(rows, words, dtype=torch.int32, device=device)
        self.int4_scale = torch.empty(rows, groups, dtype=torch.float32, device=device)
        self.int4_zero = (
            None if symmetric else torch.empty(rows, groups, dtype=torch.int8, device=device)
        )
        self.int4_group_size = size
        self.weight.data = self.weight.new_empty(0)

    def finish_int4_load(self, native: bool) -> None:
        """The loaded int4 weight becomes the projection's product, as stored, with
        activations in the model's dtype (kernels/int4_matmul.py, CPU)."""
        if self.int4_packed.device.type != "cpu":
            raise ValueError(f"int4 projections run on a CPU, not {self.int4_packed.device}")
        quantized = unpack_int4(self.int4_packed, self.in_features)
        self.packed = Int4Weight(
            quantized,
            self.int4_scale,
            self.int4_zero,
            self.int4_group_size,
            self.weight.dtype,
            native,
        )
        self.int4_packed = self.int4_scale = self.int4_zero = None

    def _load_target(self, name: str) -> torch.Tensor | None:
        if name == "int8_scale":
            return None if self.int8_scale is None else self.int8_scale.unsqueeze(1)
        return {
            "weight": self.weight,
            "bias": self.bias,
            "int8_weight": self.int8_weight,
            "int8_packed": self.int8_packed,
            "int4_packed": self.int4_packed,
            "int4_scale": self.int4_scale,
            "int4_zero": self.int4_zero,
        }[name]

    def _columns(self, name: str) -> int:
        """Columns of the checkpoint tensor loaded as `name` (its rows: output channels)."""
        if name == "int8_scale":
            return 1
        if name == "int4_packed":
            return -(-self.in_features // 8)
        if name == "int8_packed":
            return -(-self.in_features // 4)
        if name in ("int4_scale", "int4_zero"):
            return group_count(self.in_features, self.int4_group_size)
        return self.in_features

    def enable_lora(self, max_loras: int, max_rank: int, backend: KernelBackend) -> LoRAStack:
        """Allocates this projection's zeroed adapter slots in `backend`'s layout."""
        self.lora = backend.lora_stack(
            max_loras,
            max_rank,
            self.in_features,
            self.output_sizes,
            self.weight.dtype,
            self.weight.device,
        )
        self.lora_kernels = backend
        self.fold_lora_shrink()
        return self.lora

    @torch.no_grad()
    def fold_lora_shrink(self) -> bool:
        """Where the backend folds this projection's shrink (and it has no bias and an
        unquantized weight), moves `weight` and the slots' A into one tensor,
        `lora_fold`, and makes both views of it (their values unchanged; the slot
        manager writes A through `lora.a` as before); returns whether it did. Called
        when LoRA is enabled, and again after `unfold_lora_shrink` and a move of the
        weight (sleep mode)."""
        foldable = (
            self.lora is not None
            and self.lora_fold is None
            and self.bias is None
            and self.packed is None
            and self.lora_kernels.folds_lora_shrink(self.lora)
        )
        if not foldable:
            return False
        a = self.lora.a
        slots, width, in_features = a.shape
        rows = self.out_features
        fold = torch.empty(
            rows + slots * width, in_features, dtype=self.weight.dtype, device=self.weight.device
        )
        fold[:rows].copy_(self.weight)
        fold[rows:].copy_(a.reshape(slots * width, in_features))
        self.weight.data = fold[:rows]
        self.lora = dataclasses.replace(self.lora, a=fold[rows:].view(slots, width, in_features))
        self.lora_fold = fold
        return True

    @torch.no_grad()
    def unfold_lora_shrink(self) -> None:
        """The slots' A in a tensor of their own again; `weight` stays a view until it
        is moved, after which nothing holds the folded tensor (sleep mode frees it)."""
        if self.lora_fold is None:
            return
        self.lora = dataclasses.replace(self.lora, a=self.lora.a.clone())
        self.lora_fold = None

    def lora_shard(
        self, index: int, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of slice `index`'s adapter A [r, in] and B [out_i, r]."""
        start, size = self.row_ranges[index]
        return a, b[start : start + size]

    @torch.no_grad()
    def load_slice(self, index: int, name: str, tensor: CheckpointSlice) -> None:
        """Copies this rank's rows of checkpoint tensor `index` into `weight` or `bias`
        (or an int8 checkpoint's 'int8_weight' and 'int8_scale' [out, 1])."""
        target = self._load_target(name)
        if target is None:
            raise ValueError(f"{type(self).__name__} has no {name}")
        start, size = self.offsets[index], self.output_sizes[index]
        row_start = self.row_ranges[index][0]
        what = f"{name} slice {index}"
        if name == "int4_zero":
            # packed along the output channels: [ceil(rows / 8), groups] int32, read whole
            total = self.full_sizes[index]
            full = (-(-total // 8), self._columns(name))
            shape = tuple(tensor.get_shape())
            if shape != full:
                raise ValueError(f"shape mismatch for {what}: checkpoint {shape}, model {full}")
            zeros = unpack_int4(tensor[(slice(None),)].t().contiguous(), total).t()
            target[start : start + size].copy_(zeros[row_start : row_start + size])
            return
        full = (self.full_sizes[index], self._columns(name))[: target.dim()]
        rows = (slice(row_start, row_start + size),)
        _copy_checked(target[start : start + size], tensor, full, rows, what)

    def extra_repr(self) -> str:
        ranges = (
            ""
            if self.row_ranges == tuple((0, n) for n in self.output_sizes)
            else (f", row_ranges={self.row_ranges}")
        )
        return (
            f"in_features={self.in_features}, output_sizes={self.output_sizes}, "
            f"bias={self.bias is not None}{ranges}"
        )


def has_folded_projections(model: nn.Module) -> bool:
    """Whether any projection of `model` folds its LoRA shrink into its weight."""
    return any(isinstance(m, MergedLinear) and m.lora_fold is not None for m in model.modules())


class Linear(MergedLinear):
    """A single-slice projection: y = x @ W.T + b, x [T, in] -> y [T, out]."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(in_features, (out_features,), bias, dtype, device)


class RowParallelLinear(MergedLinear):
    """y = x @ W.T + b where this rank holds columns `col_range = (start, size)` of W
    (input features) and x holds the matching features: each rank computes a partial
    product, adds its partial LoRA delta (A's matching columns, B whole: linear, so the
    sum over ranks is the exact delta), then one all-reduce sums them and the bias is
    added once. Without a group (one rank) this is `Linear`.

    Shapes: x [T, size] -> y [T, out_features].
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        col_range: tuple[int, int] | None = None,
        group: TPGroup | None = None,
    ) -> None:
        self.col_range = col_range or (0, in_features)
        self.full_in_features = in_features
        super().__init__(self.col_range[1], (out_features,), bias, dtype, device)
        self.group = group

    def forward_deferred(
        self, x: torch.Tensor, lora: LoRABatch | None = None
    ) -> tuple[torch.Tensor, PendingExpand | None]:
        """As `MergedLinear.forward_deferred` on one rank; across ranks the all-reduce
        needs the whole partial products: `forward`, nothing pending."""
        if self.group is None or self.group.size == 1:
            return super().forward_deferred(x, lora)
        return self.forward(x, lora), None

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        if self.group is None or self.group.size == 1:
            return super().forward(x, lora)
        out = self._matmul(x, None)
        self._add_lora(out, x, lora)
        self.group.all_reduce(out)
        if self.bias is not None:
            out += self.bias
        return out

    def lora_shard(
        self, index: int, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start, size = self.col_range
        return a[:, start : start + size], b

    @torch.no_grad()
    def load_slice(self, index: int, name: str, tensor: CheckpointSlice) -> None:
        if name.startswith("int4_") or name == "int8_packed":
            if self.col_range != (0, self.full_in_features):
                raise ValueError("packed checkpoints are not served under tensor parallelism")
            super().load_slice(index, name, tensor)
            return
        if name in ("bias", "int8_scale"):
            super().load_slice(index, name, tensor)
            return
        start, size = self.col_range
        full = (self.full_sizes[0], self.full_in_features)
        cols = (slice(None), slice(start, start + size))
        _copy_checked(self._load_target(name), tensor, full, cols, name)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", col_range={self.col_range}"


class CheckpointSlice(Protocol):
    """A checkpoint tensor read lazily (safetensors' slice object: `get_shape()`, and
    indexing reads only the indexed part)."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor: ...


def _copy_checked(
    target: torch.Tensor,
    source: CheckpointSlice,
    full_shape: tuple[int, ...],
    index: tuple[slice, ...],
    what: str,
) -> None:
    """target <- source[index] after checking the whole checkpoint tensor's shape."""
    shape = tuple(source.get_shape())
    if shape != tuple(full_shape):
        raise ValueError(
            f"shape mismatch for {what}: checkpoint {shape}, expected {tuple(full_shape)}"
        )
    target.copy_(source[index])
