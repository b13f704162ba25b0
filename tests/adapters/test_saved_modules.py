"""The device tier of adapters' saved modules (adapters/saved_modules.py) against a
plain-torch reference, row by row: embeddings per token segment, logits per row with
vocabularies of different widths padded with -inf."""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType

import pytest
import torch

from loraplex.adapters.peft_format import LoRAAdapter
from loraplex.adapters.saved_modules import SavedModuleSlots
from loraplex.kernels.lora import LoRABatch

VOCAB, HIDDEN = 40, 8


def adapter(name: str, **saved: torch.Tensor) -> LoRAAdapter:
    return LoRAAdapter(name, Path(name), name.encode(), {}, MappingProxyType(saved))


@pytest.fixture
def tables():
    generator = torch.Generator().manual_seed(0)
    return {
        "base_embed": torch.randn(VOCAB, HIDDEN, generator=generator),
        "base_head": torch.randn(VOCAB, HIDDEN, generator=generator),
        "embed": torch.randn(VOCAB + 6, HIDDEN, generator=generator),
        "head": torch.randn(VOCAB + 6, HIDDEN, generator=generator),
        "head_same": torch.randn(VOCAB, HIDDEN, generator=generator),
    }


@pytest.fixture
def slots(tables):
    """Slot 0: embedding and head resized to 46; slot 1: a head of the base's size;
    slot 2: plain LoRA (nothing saved)."""
    saved = SavedModuleSlots(3, torch.float32, torch.device("cpu"))
    saved.write(0, adapter("resized", embed_tokens=tables["embed"], lm_head=tables["head"]))
    saved.write(1, adapter("head", lm_head=tables["head_same"]))
    saved.write(2, adapter("plain"))
    return saved


def test_embeddings_follow_each_tokens_slot(slots, tables):
    token_slots = [1, 1, 0, 0, 0, -1, 2, 0]
    ids = torch.tensor([3, 4, 44, 5, 45, 6, 7, 39])
    lora = LoRABatch.from_token_slots(token_slots, num_decode_tokens=2, device=torch.device("cpu"))
    got = slots.embed(ids, lora, lambda i: tables["base_embed"][i.clamp(max=VOCAB - 1)])
    for t, (slot, token) in enumerate(zip(token_slots, ids.tolist(), strict=True)):
        table = tables["embed"] if slot == 0 else tables["base_embed"]
        torch.testing.assert_close(got[t], table[token])


def test_logits_follow_each_rows_slot_padded_to_the_widest(slots, tables):
    rows = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(1))
    row_slots = torch.tensor([-1, 0, 1, 2, 0, -1])
    got = slots.logits(rows, row_slots, lambda h: h @ tables["base_head"].T)
    assert got.shape == (6, VOCAB + 6) and got.dtype == torch.float32
    for r, slot in enumerate(row_slots.tolist()):
        head = {0: tables["head"], 1: tables["head_same"]}.get(slot, tables["base_head"])
        want = torch.full((VOCAB + 6,), float("-inf"))
        want[: head.shape[0]] = rows[r] @ head.T
        torch.testing.assert_close(got[r], want)


def test_rows_without_a_saved_head_take_the_base_path_unchanged(slots, tables):
    rows = torch.randn(3, HIDDEN)
    base = lambda h: h @ tables["base_head"].T  # noqa: E731
    got = slots.logits(rows, torch.tensor([2, -1, 2]), base)
    torch.testing.assert_close(got, base(rows))


def test_a_slot_rewritten_or_cleared_drops_its_copies(slots, tables):
    assert slots.has_heads and slots.has_embeddings
    before = slots.num_bytes
    assert before == 4 * HIDDEN * ((VOCAB + 6) * 2 + VOCAB)
    slots.write(0, adapter("plain-again"))
    assert slots.embeddings[0] is None and slots.heads[0] is None
    assert not slots.has_embeddings
    slots.clear(1)
    assert not slots.has_heads and slots.num_bytes == 0


def test_tensor_parallel_ranks_refuse_saved_modules(tables):
    saved = SavedModuleSlots(1, torch.float32, torch.device("cpu"), allowed=False)
    saved.write(0, adapter("plain"))
    with pytest.raises(ValueError, match="not served under tensor parallelism"):
        saved.write(0, adapter("head", lm_head=tables["head_same"]))
