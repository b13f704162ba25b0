"""Device slots: adapters packed into the projections' stacks, LRU slot reuse."""

from __future__ import annotations

import pytest
import torch

from loraplex.adapters.peft_format import load_peft_adapter
from loraplex.adapters.slots import LoRASlots
from loraplex.platform.models.registry import load_model

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def setup(tiny_model_factory, tmp_path_factory, peft_adapter_factory):
    base = tiny_model_factory("llama")
    root = tmp_path_factory.mktemp("slot-adapters")
    model, arch = load_model(base, torch.float32, "cpu")
    adapters = [
        load_peft_adapter(
            peft_adapter_factory(base, root / f"a{i}", rank=rank, target_modules=targets, seed=i),
            arch,
            max_rank=8,
        )
        for i, (rank, targets) in enumerate([(4, ALL), (8, ("k_proj", "down_proj")), (2, ALL)])
    ]
    return model, adapters


def test_adapter_is_packed_at_its_rank_into_each_slice(setup):
    model, adapters = setup
    slots = LoRASlots(model.lora_targets(), max_loras=2, max_rank=8, backend="torch")
    adapter = adapters[0]
    slot = slots.activate([adapter])[adapter.key]
    rank = adapter.rank
    for (layer, name), weights in adapter.modules.items():
        module, index = slots.targets[(layer, name)]
        start, size = module.offsets[index], module.output_sizes[index]
        cols = slice(index * rank, (index + 1) * rank)
        torch.testing.assert_close(module.lora.a[slot, cols], weights.a)
        torch.testing.assert_close(module.lora.b[slot, start : start + size, cols], weights.b)
        # Nothing outside the slice's block is written.
        block = module.lora.b[slot, start : start + size].clone()
        block[:, cols] = 0
        assert not block.any()
    assert slots.slot_ranks()[slot] == rank


def test_slots_are_reused_lru_and_never_evict_a_wanted_adapter(setup):
    model, (a, b, c) = setup
    slots = LoRASlots(model.lora_targets(), max_loras=2, max_rank=8, backend="torch")
    first = slots.activate([a, b])
    assert slots.activate([a]) == {a.key: first[a.key]}
    placed = slots.activate([c, a])
    assert placed[a.key] == first[a.key] and placed[c.key] == first[b.key]
    assert slots.stats.loads == 3 and slots.stats.evictions == 1
    assert {x.name for x in slots.resident} == {a.name, c.name}
    # c (rank 2) replaced b (rank 8): b's wider columns were cleared, not left behind.
    slot = placed[c.key]
    for module in slots.projections:
        used = module.lora.num_slices * c.rank
        assert not module.lora.a[slot, used:].any()
        assert not module.lora.b[slot, :, used:].any()
    with pytest.raises(RuntimeError, match="only 2 slots"):
        slots.activate([a, b, c])
