"""One model split over 2 tensor-parallel ranks (run as threads, joined by a gloo group)
gives the logits of the unsplit model, LoRA adapters included: kv heads split evenly,
unevenly (3 over 2 ranks) and replicated (1 kv head on 2 ranks), Qwen2 biases, tied
embeddings. Each rank holds only its shard of the weights and of the KV cache."""

from __future__ import annotations

import threading

import pytest
import torch

from loraplex.adapters.peft_format import load_peft_adapter
from loraplex.adapters.slots import LoRASlots
from loraplex.kernels.attention_metadata import AttentionMetadata
from loraplex.kernels.lora import LoRABatch
from loraplex.platform.kv_cache import allocate_kv_caches
from loraplex.platform.models.registry import load_model
from loraplex.platform.parallel.group import TPGroup
from loraplex.platform.parallel.layout import TPLayout

BLOCK_SIZE = 4
NUM_BLOCKS = 16
PROMPT = [5, 17, 99, 3, 250, 7, 7, 42, 300, 11, 64]

MODELS = {
    "llama-kv-split": ("llama", dict()),
    "llama-kv-uneven": (
        "llama",
        dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3),
    ),
    "llama-kv-replicated": ("llama", dict(num_key_value_heads=1)),
    "qwen2-bias": ("qwen2", dict()),
    "llama3-tied": ("llama3", dict(tie_word_embeddings=True)),
}


def prefill_then_decode(model, arch, layout, lora_slot: int | None) -> torch.Tensor:
    """Logits [2, vocab]: the prompt's last token after one prefill, then one decode."""
    kv_caches = allocate_kv_caches(
        arch, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu", layout.num_kv_heads
    )
    table = torch.tensor([[3, 9, 0, 12]])
    n = len(PROMPT)
    slots = torch.tensor(
        [table[0, p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(n + 1)]
    )
    rows = []
    with torch.inference_mode():
        for ids, positions, meta in (
            (
                PROMPT,
                torch.arange(n),
                AttentionMetadata(
                    BLOCK_SIZE,
                    slots[:n],
                    0,
                    table[:0],
                    torch.zeros(0, dtype=torch.int64),
                    [n],
                    [n],
                    table,
                ),
            ),
            (
                [PROMPT[-1]],
                torch.tensor([n]),
                AttentionMetadata(
                    BLOCK_SIZE, slots[n:], 1, table, torch.tensor([n + 1]), [], [], table[:0]
                ),
            ),
        ):
            lora = None
            if lora_slot is not None:
                lora = LoRABatch.from_token_slots(
                    [lora_slot] * len(ids), meta.num_decode_tokens, torch.device("cpu")
                )
            hidden = model(torch.tensor(ids), positions, kv_caches, meta, lora)
            rows.append(model.compute_logits(hidden[-1:])[0])
    return torch.stack(rows), kv_caches


def run_rank(folder, rank: int, size: int, port: int, store, adapter_folder, results) -> None:
    try:
        group = TPGroup.connect(rank, size, port, torch.device("cpu"), 20.0, store)
        model, arch = load_model(folder, torch.float32, "cpu", rank=rank, group=group)
        slot = None
        if adapter_folder is not None:
            slots = LoRASlots(model.lora_targets(), 2, 8, "torch")
            adapter = load_peft_adapter(adapter_folder, arch, 8, name="a")
            slot = slots.activate([adapter])[adapter.key]
        layout = TPLayout.create(arch, rank, size)
        logits, kv_caches = prefill_then_decode(model, arch, layout, slot)
        weights = sum(p.numel() for p in model.parameters())
        results[rank] = (logits, weights, sum(c.numel() for c in kv_caches))
    except BaseException as exc:  # reported by the test thread
        results[rank] = exc


def sharded(folder, size: int, adapter_folder=None) -> dict[int, tuple]:
    store = TPGroup.make_store(size, 20.0)
    results: dict[int, object] = {}
    threads = [
        threading.Thread(
            target=run_rank,
            args=(folder, r, size, store.port, store if r == 0 else None, adapter_folder, results),
        )
        for r in range(size)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for rank in range(size):
        if isinstance(results.get(rank), BaseException):
            raise results[rank]
    return results


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("with_lora", [False, True], ids=["base", "lora"])
def test_two_ranks_give_the_unsplit_logits(
    tiny_model_factory, peft_adapter_factory, tmp_path, name, with_lora
):
    kind, overrides = MODELS[name]
    folder = tiny_model_factory(kind, **overrides)
    adapter = None
    if with_lora:
        targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
        adapter = peft_adapter_factory(folder, tmp_path / "adapter", rank=8, target_modules=targets)
    single = sharded(folder, 1, adapter)[0]
    split = sharded(folder, 2, adapter)
    for rank in (0, 1):
        torch.testing.assert_close(split[rank][0], single[0], atol=2e-5, rtol=2e-5)
    assert split[0][0].argmax(-1).tolist() == single[0].argmax(-1).tolist()
    # Each rank holds a strict part of the weights (norms are replicated).
    assert all(split[r][1] < single[1] for r in (0, 1))
    if name != "llama-kv-replicated":
        assert split[0][2] + split[1][2] == single[2]


def test_layout_splits_heads_by_kv_group():
    from loraplex.platform.arch import ModelArch, RopeConfig
    from loraplex.platform.parallel.layout import split

    assert [split(10, 3, r) for r in range(3)] == [(0, 4), (4, 3), (7, 3)]

    def arch(heads, kv_heads):
        return ModelArch(
            architecture="LlamaForCausalLM",
            vocab_size=100,
            hidden_size=heads * 8,
            intermediate_size=32,
            num_layers=1,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=8,
            rms_norm_eps=1e-6,
            rope=RopeConfig(),
            max_position_embeddings=64,
            tie_word_embeddings=False,
            qkv_bias=False,
            o_bias=False,
            mlp_bias=False,
        )

    smol = [TPLayout.create(arch(9, 3), r, 2) for r in (0, 1)]
    assert [(x.q_heads, x.kv_heads) for x in smol] == [((0, 6), (0, 2)), ((6, 3), (2, 1))]
    replicated = [TPLayout.create(arch(8, 2), r, 4) for r in range(4)]
    assert [(x.q_heads, x.kv_heads) for x in replicated] == [
        ((0, 2), (0, 1)),
        ((2, 2), (0, 1)),
        ((4, 2), (1, 1)),
        ((6, 2), (1, 1)),
    ]
    with pytest.raises(ValueError, match="cannot split"):
        TPLayout.create(arch(9, 3), 0, 4)
    with pytest.raises(ValueError, match="out of"):
        TPLayout.create(arch(8, 2), 2, 2)
