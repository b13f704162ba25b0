"""Device tier of adapters' `modules_to_save`: per slot, the adapter's own embedding
table and LM head, when it saved them (PEFT's `modules_to_save = ["embed_tokens",
"lm_head"]`).

A slot's copies live beside its LoRA stacks (adapters/slots.py writes and clears both)
and take memory only while an adapter that saved them holds the slot: each copy is a
whole [vocab, hidden] matrix, as large as the base's.

Semantics:
- `embed(input_ids [T], lora, base)`: the hidden states [T, hidden] of the step's
  tokens: a token whose slot saved `embed_tokens` looks up that table, every other
  token `base(input_ids)` (the base model's lookup; ids past its vocabulary only occur
  in slots with a resized table and are clamped by the caller's `base`).
- `logits(rows [R, hidden], row_slots [R], base)`: float32 logits [R, W]: a row whose
  slot saved `lm_head` is `rows @ head.T` over the adapter's vocabulary, every other row
  `base(rows)`; W is the widest vocabulary among them, and a row's columns past its own
  vocabulary are -inf (never sampled, zero probability).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from loraplex.adapters.peft_format import LoRAAdapter
from loraplex.kernels.cpu_matmul import linear
from loraplex.kernels.lora import LoRABatch


class SavedModuleSlots:
    """`max_loras` slots, each holding the embedding table and LM head its adapter saved
    (None where it saved none), in the model's dtype on its device."""

    def __init__(
        self, max_loras: int, dtype: torch.dtype, device: torch.device, allowed: bool = True
    ) -> None:
        """`allowed` False (a tensor-parallel rank): an adapter with saved modules is
        refused when it is written, naming why."""
        self.dtype = dtype
        self.device = device
        self.allowed = allowed
        self.embeddings: list[torch.Tensor | None] = [None] * max_loras
        self.heads: list[torch.Tensor | None] = [None] * max_loras

    @property
    def num_bytes(self) -> int:
        tables = [t for t in (*self.embeddings, *self.heads) if t is not None]
        return sum(t.numel() * t.element_size() for t in tables)

    @property
    def has_embeddings(self) -> bool:
        return any(t is not None for t in self.embeddings)

    @property
    def has_heads(self) -> bool:
        return any(t is not None for t in self.heads)

    def write(self, slot: int, adapter: LoRAAdapter) -> None:
        """Holds `adapter`'s saved modules in `slot` (or none, freeing the previous
        adapter's copies)."""
        self.clear(slot)
        saved = adapter.saved_modules
        if saved and not self.allowed:
            raise ValueError(
                f"adapter {adapter.name!r} saves {sorted(saved)} (modules_to_save), which "
                "is not served under tensor parallelism"
            )
        for name, table in saved.items():
            copy = table.to(self.device, self.dtype, copy=True)
            if name == "embed_tokens":
                self.embeddings[slot] = copy
            else:
                self.heads[slot] = copy

    def clear(self, slot: int) -> None:
        self.embeddings[slot] = None
        self.heads[slot] = None

    def embed(
        self,
        input_ids: torch.Tensor,
        lora: LoRABatch,
        base: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """See the module docstring."""
        hidden = base(input_ids)
        for start, end, slot in lora.segments:
            table = self.embeddings[slot]
            if table is not None:
                hidden[start:end] = F.embedding(input_ids[start:end], table)
        return hidden

    def logits(
        self,
        rows: torch.Tensor,
        row_slots: torch.Tensor,
        base: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """See the module docstring."""
        own = {
            slot: self.heads[slot]
            for slot in row_slots.unique().tolist()
            if slot >= 0 and self.heads[slot] is not None
        }
        if not own:
            return base(rows)
        on_base = torch.ones_like(row_slots, dtype=torch.bool)
        for slot in own:
            on_base &= row_slots != slot
        base_logits = base(rows[on_base]) if bool(on_base.any()) else None
        width = max(
            [head.shape[0] for head in own.values()]
            + ([base_logits.shape[-1]] if base_logits is not None else [])
        )
        logits = torch.full(
            (rows.shape[0], width), float("-inf"), dtype=torch.float32, device=rows.device
        )
        if base_logits is not None:
            logits[on_base, : base_logits.shape[-1]] = base_logits
        for slot, head in own.items():
            mine = row_slots == slot
            logits[mine, : head.shape[0]] = linear(rows[mine], head, None).float()
        return logits
