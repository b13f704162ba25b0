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

logger = logging.getLogger(__name__)

_ALWAYS_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_SHOWN = 8


@dataclass(frozen=True)
class WeightTarget:
    """Where one checkpoint tensor goes: `module.attr`, or slice `slice_index` of it
    for fused projections (modules with `load_slice`)."""

    module: nn.Module
    attr: str
    slice_index: int | None = None

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor) -> None:
        if self.slice_index is not None:
            self.module.load_slice(self.slice_index, self.attr, tensor)
            return
        param = getattr(self.module, self.attr)
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(
                f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, "
                f"model {tuple(param.shape)}"
            )
        param.copy_(tensor)


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
                    targets[name].load(name, handle.get_tensor(name))
    logger.info("loaded %d tensors from %d file(s) in %s", len(targets), len(files), folder)
