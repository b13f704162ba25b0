"""Reads HF safetensors checkpoints (single file or sharded) into model parameters."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from loraplex.platform.layers.linear import CheckpointSlice

logger = logging.getLogger(__name__)

_ALWAYS_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_SHOWN = 8


@dataclass(frozen=True)
class WeightTarget:
    """Where one checkpoint tensor goes: `module.attr`, or slice `slice_index` of it
    for fused projections (modules with `load_slice`, which pick their own shard).
    `rows = (start, size, total)` loads only rows start .. start + size - 1 of a
    checkpoint tensor of `total` rows (a tensor-parallel vocabulary shard)."""

    module: nn.Module
    attr: str
    slice_index: int | None = None
    rows: tuple[int, int, int] | None = None

    @torch.no_grad()
    def load(self, name: str, source: CheckpointSlice) -> None:
        """Reads this target's part of checkpoint tensor `name` (only that part)."""
        if self.slice_index is not None:
            self.module.load_slice(self.slice_index, self.attr, source)
            return
        param = getattr(self.module, self.attr)
        shape = tuple(source.get_shape())
        expected = tuple(param.shape)
        index: tuple[slice, ...] = (slice(None),)
        if self.rows is not None:
            start, size, total = self.rows
            expected = (total, *param.shape[1:])
            index = (slice(start, start + size),)
        if shape != expected:
            raise ValueError(
                f"shape mismatch for {name}: checkpoint {shape}, model {tuple(param.shape)}"
            )
        param.copy_(source[index])


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards its index names, else every
    *.safetensors file in the folder."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    return files


def _listing(names: Iterable[str]) -> str:
    names = sorted(names)
    more = f" (+{len(names) - _SHOWN} more)" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def load_checkpoint(
    folder: Path, targets: dict[str, WeightTarget], ignored: Iterable[str] = ()
) -> None:
    """Copies every tensor named in `targets` from the checkpoint (casting to the
    parameter's dtype/device); ValueError if any target is missing from the checkpoint
    or the checkpoint holds a tensor neither targeted nor `ignored`."""
    ignored = set(ignored)
    files = checkpoint_files(folder)
    names_by_file: dict[Path, list[str]] = {}
    for file in files:
        with safe_open(file, framework="pt") as handle:
            names_by_file[file] = list(handle.keys())
    present = {name for names in names_by_file.values() for name in names}
    unexpected = {
        name
        for name in present - set(targets) - ignored
        if not name.endswith(_ALWAYS_IGNORED_SUFFIXES)
    }
    missing = set(targets) - present
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {folder} does not match the model: "
            f"missing [{_listing(missing)}]; unexpected [{_listing(unexpected)}]"
        )
    for file, names in names_by_file.items():
        with safe_open(file, framework="pt") as handle:
            for name in names:
                if name in targets:
                    targets[name].load(name, handle.get_slice(name))
    logger.info("loaded %d tensors from %d file(s) in %s", len(targets), len(files), folder)
