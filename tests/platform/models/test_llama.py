"""Our Llama-family model on the paged cache vs Hugging Face transformers (fp32)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.kernels.attention_metadata import AttentionMetadata
from loraplex.kernels.torch_layers import apply_rotary
from loraplex.platform.arch import ModelArch, RopeConfig
from loraplex.platform.kv_cache import allocate_kv_caches
from loraplex.platform.layers.rotary import RotaryEmbedding, compute_inv_freq
from loraplex.platform.models.registry import load_model

BLOCK_SIZE = 4
NUM_BLOCKS = 48
VOCAB = 256

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

# name -> (HF config class name, config overrides)
MODELS: dict[str, tuple[str, dict]] = {
    "llama-gqa": ("LlamaConfig", {}),
    "llama3-tied": ("LlamaConfig", {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True}),
    "llama-bias-mha": (
        "LlamaConfig",
        {"attention_bias": True, "mlp_bias": True, "num_key_value_heads": 4},
    ),
    "qwen2-mha": ("Qwen2Config", {"num_key_value_heads": 4}),
    "qwen2-tied": ("Qwen2Config", {"tie_word_embeddings": True}),
    "mistral": ("MistralConfig", {}),
}


def make_hf_model(name: str):
    """A seeded random tiny HF model with every weight and bias non-trivial."""
    import transformers

    config_class, overrides = MODELS[name]
    options = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    options.update(overrides)
    config = getattr(transformers, config_class)(**options)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.08)
            elif param_name.endswith("bias"):
                param.normal_(0.0, 0.1)
            else:
                param.uniform_(0.8, 1.2)
    return model.eval()


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    """name -> (folder, HF model), built once per module on first use."""
    cache: dict[str, tuple[Path, torch.nn.Module]] = {}

    def get(name: str) -> tuple[Path, torch.nn.Module]:
        if name not in cache:
            folder = tmp_path_factory.mktemp(name)
            hf_model = make_hf_model(name)
            hf_model.save_pretrained(folder)
            cache[name] = (folder, hf_model)
        return cache[name]

    return get


def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def build_attention_metadata(
    decodes: list[tuple[list[int], int]],
    prefills: list[tuple[list[int], int, int]],
    block_size: int = BLOCK_SIZE,
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata for one step from python lists, plus the step's positions [T].

    decodes: (block table, seq_len incl. the new token) per decode sequence;
    prefills: (block table, query_len, seq_len after the chunk) per prefill sequence.
    """

    def pad(tables: list[list[int]]) -> torch.Tensor:
        width = max((len(t) for t in tables), default=0)
        rows = [t + [0] * (width - len(t)) for t in tables]
        return torch.tensor(rows, dtype=torch.int64).reshape(len(tables), width)

    positions: list[int] = []
    slots: list[int] = []
    spans = [(table, 1, seq_len) for table, seq_len in decodes] + prefills
    for table, query_len, seq_len in spans:
        for p in range(seq_len - query_len, seq_len):
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
    meta = AttentionMetadata(
        block_size=block_size,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_decode_tokens=len(decodes),
        decode_block_tables=pad([table for table, _ in decodes]),
        decode_seq_lens=torch.tensor([seq_len for _, seq_len in decodes], dtype=torch.int64),
        prefill_query_lens=[q for _, q, _ in prefills],
        prefill_seq_lens=[s for _, _, s in prefills],
        prefill_block_tables=pad([table for table, _, _ in prefills]),
    )
    return meta, torch.tensor(positions, dtype=torch.int64)


@dataclass(eq=False)
class Sequence:
    token_ids: list[int]
    computed: int = 0
    table: list[int] = field(default_factory=list)


class MiniRunner:
    """Just enough of a model runner to drive the model step by step in tests."""

    def __init__(self, model, arch: ModelArch, seed: int = 0) -> None:
        self.model = model
        self.kv_caches = allocate_kv_caches(
            arch, NUM_BLOCKS, BLOCK_SIZE, torch.float32, torch.device("cpu")
        )
        generator = torch.Generator().manual_seed(seed)
        self.free_blocks = torch.randperm(NUM_BLOCKS, generator=generator).tolist()

    def step(self, schedule: list[tuple[Sequence, int]]) -> list[torch.Tensor]:
        """Runs one step; returns the logits of each scheduled chunk's last token."""
        decodes = [(s, n) for s, n in schedule if n == 1 and s.computed > 0]
        prefills = [(s, n) for s, n in schedule if (s, n) not in decodes]
        for seq, n in decodes + prefills:
            while len(seq.table) * BLOCK_SIZE < seq.computed + n:
                seq.table.append(self.free_blocks.pop())
        meta, positions = build_attention_metadata(
            [(s.table, s.computed + 1) for s, _ in decodes],
            [(s.table, n, s.computed + n) for s, n in prefills],
        )
        input_ids = torch.tensor(
            [t for s, n in decodes + prefills for t in s.token_ids[s.computed : s.computed + n]]
        )
        with torch.inference_mode():
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
            last_rows = torch.tensor([n for _, n in decodes + prefills]).cumsum(0) - 1
            logits = self.model.compute_logits(hidden[last_rows])
        for seq, n in decodes + prefills:
            seq.computed += n
        order = [id(s) for s, _ in decodes + prefills]
        return [logits[order.index(id(s))] for s, _ in schedule]


@pytest.mark.parametrize("name", list(MODELS))
def test_full_prefill_matches_hf(saved_models, name):
    folder, hf_model = saved_models(name)
    model, arch = load_model(folder, torch.float32, "cpu")
    token_ids = torch.randint(0, VOCAB, (13,), generator=torch.Generator().manual_seed(5)).tolist()
    table = [37, 2, 19, 0]
    meta, positions = build_attention_metadata([], [(table, 13, 13)])
    kv_caches = allocate_kv_caches(arch, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu")
    with torch.inference_mode():
        hidden = model(torch.tensor(token_ids), positions, kv_caches, meta)
        logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (13, VOCAB)
    torch.testing.assert_close(logits, hf_logits(hf_model, token_ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama-gqa", "llama3-tied", "qwen2-mha"])
def test_chunked_prefill_and_batched_decodes_match_hf(saved_models, name):
    folder, hf_model = saved_models(name)
    model, arch = load_model(folder, torch.float32, "cpu")
    generator = torch.Generator().manual_seed(7)
    a, b, c = (
        Sequence(torch.randint(0, VOCAB, (n,), generator=generator).tolist()) for n in (14, 10, 6)
    )
    schedule = [
        [(a, 4)],
        [(a, 5), (b, 7)],
        [(b, 1), (a, 2), (c, 3)],
        [(a, 1), (c, 3), (b, 1)],
        [(b, 1), (a, 1)],
        [(a, 1)],
    ]
    runner = MiniRunner(model, arch)
    expected = {id(s): hf_logits(hf_model, s.token_ids) for s in (a, b, c)}
    for step in schedule:
        for (seq, _), logits in zip(step, runner.step(step), strict=True):
            want = expected[id(seq)][seq.computed - 1]
            torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
    assert (a.computed, b.computed, c.computed) == (14, 10, 6)


def test_sharded_checkpoint_loads_the_same(saved_models, tmp_path):
    folder, hf_model = saved_models("llama-gqa")
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    single, _ = load_model(folder, torch.float32, "cpu")
    sharded, _ = load_model(tmp_path, torch.float32, "cpu")
    for (name, p), (_, q) in zip(
        single.state_dict().items(), sharded.state_dict().items(), strict=True
    ):
        assert torch.equal(p, q), name


def test_bf16_load_casts_weights(saved_models):
    folder, _ = saved_models("llama-gqa")
    model, _ = load_model(folder, torch.bfloat16, "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("change", ["drop", "extra"])
def test_checkpoint_mismatch_is_a_clear_error(saved_models, tmp_path, change):
    folder, _ = saved_models("llama-gqa")
    tensors = load_file(folder / "model.safetensors")
    if change == "drop":
        del tensors["model.layers.1.self_attn.k_proj.weight"]
    else:
        tensors["model.layers.0.mystery.weight"] = torch.zeros(2)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    match = "k_proj" if change == "drop" else "mystery"
    with pytest.raises(ValueError, match=match):
        load_model(tmp_path, torch.float32, "cpu")


def test_arch_from_hf_and_legacy_configs(saved_models):
    folder, _ = saved_models("qwen2-mha")
    arch = ModelArch.from_folder(folder)
    assert (arch.architecture, arch.qkv_bias, arch.o_bias, arch.head_dim) == (
        "Qwen2ForCausalLM",
        True,
        False,
        16,
    )
    assert arch.kv_bytes_per_token(torch.bfloat16) == 2 * 2 * 4 * 16 * 2
    legacy = json.loads((folder / "config.json").read_text())
    legacy.pop("rope_parameters")
    legacy.update(
        architectures=["LlamaForCausalLM"],
        rope_theta=1000.0,
        rope_scaling={"type": "linear", "factor": 2.0},
    )
    rope = ModelArch.from_hf_config(legacy).rope
    assert rope == RopeConfig(theta=1000.0, rope_type="linear", factor=2.0)


@pytest.mark.parametrize(
    "patch,match",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "LlamaForCausalLM"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ],
)
def test_unsupported_configs_are_rejected(saved_models, patch, match):
    folder, _ = saved_models("llama-gqa")
    config = json.loads((folder / "config.json").read_text())
    config.update(patch)
    with pytest.raises(ValueError, match=match):
        ModelArch.from_hf_config(config)


@pytest.mark.parametrize("name", ["llama-gqa", "llama3-tied"])
def test_rotary_matches_hf_exactly(saved_models, name):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    _, hf_model = saved_models(name)
    arch = ModelArch.from_hf_config(hf_model.config.to_dict())
    hf_rotary = LlamaRotaryEmbedding(hf_model.config)
    assert torch.equal(compute_inv_freq(arch.head_dim, arch.rope), hf_rotary.inv_freq)
    positions = torch.tensor([0, 3, 17, 100, 127])
    q = torch.randn(1, arch.num_heads, len(positions), arch.head_dim)
    k = torch.randn(1, arch.num_kv_heads, len(positions), arch.head_dim)
    cos, sin = hf_rotary(q, positions[None])
    hf_q, hf_k = apply_rotary_pos_emb(q, k, cos, sin)
    ours = RotaryEmbedding(arch.head_dim, 8, arch.rope)
    our_cos, our_sin = ours.cos_sin(positions, torch.float32)
    torch.testing.assert_close(
        apply_rotary(q[0].transpose(0, 1), our_cos, our_sin),
        hf_q[0].transpose(0, 1),
        atol=0,
        rtol=0,
    )
    torch.testing.assert_close(
        apply_rotary(k[0].transpose(0, 1), our_cos, our_sin),
        hf_k[0].transpose(0, 1),
        atol=0,
        rtol=0,
    )
