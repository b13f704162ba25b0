"""PEFT LoRA adapter loading: real PEFT adapters load exactly; broken ones are refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.adapters.peft_format import (
    SUPPORTED_MODULES,
    AdapterError,
    expected_lora_shapes,
    load_peft_adapter,
)
from loraplex.platform.models.arch import ModelArch

PREFIX = "base_model.model.model.layers"
Q_A = f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"
Q_B = f"{PREFIX}.0.self_attn.q_proj.lora_B.weight"
PATTERNS = dict(
    rank=4,
    alpha=8.0,
    target_modules=SUPPORTED_MODULES,
    # keys as PEFT users write them: bare suffix, dotted suffix, anchored regex
    rank_pattern={"q_proj": 8, "layers.1.self_attn.v_proj": 2, "^model.layers.0.mlp.up_proj": 3},
    alpha_pattern={"v_proj": 4.0, "o_proj": 5.0, r"layers\.1\.mlp\..*": 12.0},
)


@pytest.fixture(scope="session")
def make_peft_adapter(peft_adapter_factory):
    return peft_adapter_factory


@pytest.fixture(scope="session")
def base(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def arch(base) -> ModelArch:
    return ModelArch.from_folder(base)


@pytest.fixture(scope="session")
def adapters(make_peft_adapter, base, tmp_path_factory) -> dict[str, Path]:
    """Real PEFT adapters on the tiny llama: plain (all 7 modules), rsLoRA, patterns."""
    root = tmp_path_factory.mktemp("peft-adapters")
    return {
        "plain": make_peft_adapter(base, root / "plain", target_modules=SUPPORTED_MODULES),
        "rslora": make_peft_adapter(
            base, root / "rslora", rank=4, alpha=6.0, use_rslora=True, seed=1
        ),
        "patterns": make_peft_adapter(base, root / "patterns", seed=2, **PATTERNS),
    }


@pytest.fixture
def plain_copy(adapters, tmp_path) -> Path:
    """A private copy of the plain adapter for a test to break."""
    return Path(shutil.copytree(adapters["plain"], tmp_path / "adapter"))


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(changes)
    (folder / "adapter_config.json").write_text(json.dumps(config))


def edit_tensors(folder: Path, edit) -> None:
    file = folder / "adapter_model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def save_peft_config_adapter(base: Path, out: Path, **lora_kwargs) -> Path:
    """An adapter saved by PEFT for a LoraConfig make_peft_adapter cannot express."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], **lora_kwargs)
    get_peft_model(model, config).save_pretrained(out)
    return out


# --- real adapters load exactly as PEFT applies them ---------------------------------


@pytest.mark.parametrize("kind", ["plain", "rslora", "patterns"])
def test_matches_peft(kind, adapters, base, arch):
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    adapter = load_peft_adapter(adapters[kind], arch, max_rank=8)
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapters[kind]
    )
    raw = load_file(adapters[kind] / "adapter_model.safetensors")
    layers = peft_model.base_model.model.model.layers
    peft_modules = {
        (int(module_name.split(".")[4]), module_name.split(".")[-1])
        for module_name, module in peft_model.named_modules()
        if isinstance(module, LoraLayer)
    }
    assert set(adapter.modules) == peft_modules
    for (i, name), weights in adapter.modules.items():
        parent = "self_attn" if name in SUPPORTED_MODULES[:4] else "mlp"
        peft_layer = getattr(getattr(layers[i], parent), name)
        scaling = peft_layer.scaling["default"]
        assert weights.scaling == pytest.approx(scaling, rel=1e-12)
        assert weights.rank == peft_layer.r["default"]
        assert weights.a.dtype == weights.b.dtype == torch.float32
        assert weights.a.is_contiguous() and weights.b.is_contiguous()
        out_features, in_features = expected_lora_shapes(arch)[name]
        assert weights.a.shape == (weights.rank, in_features)
        assert weights.b.shape == (out_features, weights.rank)
        assert torch.equal(weights.a, peft_layer.lora_A["default"].weight)
        assert torch.equal(weights.b, peft_layer.lora_B["default"].weight * scaling)
        stem = f"{PREFIX}.{i}.{parent}.{name}"
        assert torch.equal(weights.a, raw[f"{stem}.lora_A.weight"])
        assert torch.equal(weights.b, raw[f"{stem}.lora_B.weight"] * weights.scaling)
        x = torch.randn(3, in_features)
        if i == 0:
            with torch.no_grad():
                delta = peft_layer(x) - peft_layer.base_layer(x)
            torch.testing.assert_close(x @ weights.a.T @ weights.b.T, delta)


def test_adapter_properties(adapters, arch):
    plain = load_peft_adapter(adapters["plain"], arch, max_rank=8)
    assert plain.name == "plain" and plain.path == adapters["plain"]
    assert plain.target_modules == frozenset(SUPPORTED_MODULES)
    assert len(plain.modules) == arch.num_layers * len(SUPPORTED_MODULES)
    assert plain.rank == 4
    assert plain.num_bytes == sum(4 * (m.a.numel() + m.b.numel()) for m in plain.modules.values())
    assert len(plain.key) == 16 and plain.key_hex == plain.key.hex()
    with pytest.raises(TypeError):
        plain.modules[(0, "q_proj")] = plain.modules[(0, "k_proj")]

    rslora = load_peft_adapter(adapters["rslora"], arch, max_rank=4, name="rs")
    assert rslora.name == "rs"
    assert rslora.target_modules == frozenset({"q_proj", "v_proj"})
    assert {m.scaling for m in rslora.modules.values()} == {6.0 / 2.0}

    patterns = load_peft_adapter(adapters["patterns"], arch, max_rank=8)
    assert patterns.rank == 8
    scalings = {k: m.scaling for k, m in patterns.modules.items()}
    assert scalings[(0, "q_proj")] == 8.0 / 8
    assert scalings[(1, "v_proj")] == 4.0 / 2
    assert scalings[(0, "v_proj")] == 4.0 / 4
    assert scalings[(0, "o_proj")] == 5.0 / 4
    assert scalings[(0, "up_proj")] == pytest.approx(8.0 / 3)
    assert scalings[(1, "up_proj")] == 12.0 / 4
    assert scalings[(0, "gate_proj")] == 8.0 / 4


def test_qwen2_adapter_loads(make_peft_adapter, tiny_model_factory, tmp_path):
    base = tiny_model_factory("qwen2")
    folder = make_peft_adapter(base, tmp_path / "qwen", target_modules=("k_proj", "down_proj"))
    adapter = load_peft_adapter(folder, ModelArch.from_folder(base), max_rank=4)
    assert adapter.target_modules == frozenset({"k_proj", "down_proj"})


def test_half_precision_tensors_become_float32(plain_copy, adapters, arch):
    edit_tensors(plain_copy, lambda t: t.update({k: v.to(torch.bfloat16) for k, v in t.items()}))
    adapter = load_peft_adapter(plain_copy, arch, max_rank=8)
    raw = load_file(plain_copy / "adapter_model.safetensors")
    weights = adapter.modules[(0, "q_proj")]
    assert weights.a.dtype == weights.b.dtype == torch.float32
    assert torch.equal(weights.a, raw[Q_A].float())
    assert torch.equal(weights.b, raw[Q_B].float() * 2.0)
    assert adapter.key != load_peft_adapter(adapters["plain"], arch, max_rank=8).key


def test_training_only_fields_are_ignored(plain_copy, adapters, arch):
    edit_config(
        plain_copy,
        lora_dropout=0.3,
        init_lora_weights="gaussian",
        target_modules=["q_proj"],
        base_model_name_or_path="somewhere/else",
        inference_mode=False,
    )
    original = load_peft_adapter(adapters["plain"], arch, max_rank=8)
    assert load_peft_adapter(plain_copy, arch, max_rank=8).key == original.key


# --- identity --------------------------------------------------------------------------


def test_key_ignores_name_and_path(plain_copy, adapters, arch):
    original = load_peft_adapter(adapters["plain"], arch, max_rank=8)
    copy = load_peft_adapter(plain_copy, arch, max_rank=8, name="someone-else")
    assert copy.key == original.key
    assert (copy.name, copy.path) != (original.name, original.path)


def test_key_changes_with_one_weight(plain_copy, adapters, arch):
    def nudge(tensors):
        tensors[Q_B][0, 0] += 1e-3

    edit_tensors(plain_copy, nudge)
    original = load_peft_adapter(adapters["plain"], arch, max_rank=8)
    assert load_peft_adapter(plain_copy, arch, max_rank=8).key != original.key


def test_key_changes_with_alpha(plain_copy, adapters, arch):
    edit_config(plain_copy, lora_alpha=16)
    original = load_peft_adapter(adapters["plain"], arch, max_rank=8)
    changed = load_peft_adapter(plain_copy, arch, max_rank=8)
    assert changed.key != original.key
    assert changed.modules[(0, "q_proj")].scaling == 4.0


# --- directory and files -------------------------------------------------------------


def test_missing_directory(tmp_path, arch):
    with pytest.raises(AdapterError, match="does not exist"):
        load_peft_adapter(tmp_path / "nope", arch, max_rank=8)


def test_not_a_directory(tmp_path, arch):
    (tmp_path / "file").write_text("x")
    with pytest.raises(AdapterError, match="is not a directory"):
        load_peft_adapter(tmp_path / "file", arch, max_rank=8)


def test_missing_config(plain_copy, arch):
    (plain_copy / "adapter_config.json").unlink()
    with pytest.raises(AdapterError, match="adapter_config.json is missing"):
        load_peft_adapter(plain_copy, arch, max_rank=8)


def test_config_not_json(plain_copy, arch):
    (plain_copy / "adapter_config.json").write_text("{'r': 4,")
    with pytest.raises(AdapterError, match="is not valid JSON"):
        load_peft_adapter(plain_copy, arch, max_rank=8)


def test_config_not_an_object(plain_copy, arch):
    (plain_copy / "adapter_config.json").write_text("[1, 2]")
    with pytest.raises(AdapterError, match="must hold a JSON object, got list"):
        load_peft_adapter(plain_copy, arch, max_rank=8)


def test_missing_safetensors(plain_copy, arch):
    (plain_copy / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="adapter_model.safetensors is missing"):
        load_peft_adapter(plain_copy, arch, max_rank=8)


def test_pickled_bin_only(plain_copy, arch):
    (plain_copy / "adapter_model.safetensors").rename(plain_copy / "adapter_model.bin")
    with pytest.raises(AdapterError, match=r"pickled \.bin adapters are not supported, convert"):
        load_peft_adapter(plain_copy, arch, max_rank=8)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors(damage, plain_copy, arch):
    file = plain_copy / "adapter_model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 100] if damage == "truncate" else b"\x07" * 64)
    with pytest.raises(AdapterError, match="corrupt or truncated"):
        load_peft_adapter(plain_copy, arch, max_rank=8)


# --- config --------------------------------------------------------------------------


@pytest.mark.parametrize("peft_type", ["LOHA", "IA3", "PREFIX_TUNING", None])
def test_other_peft_types(peft_type, plain_copy, arch):
    edit_config(plain_copy, peft_type=peft_type)
    with pytest.raises(AdapterError, match=f"peft_type {peft_type!r} is not supported"):
        load_peft_adapter(plain_copy, arch, max_rank=8)


def test_dora_saved_by_peft(base, arch, tmp_path):
    folder = save_peft_config_adapter(base, tmp_path / "dora", use_dora=True)
    with pytest.raises(AdapterError, match="DoRA is not supported"):
        load_peft_adapter(folder, arch, max_rank=8)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("fan_in_fan_out", True),
        ("bias", "all"),
        ("bias", "lora_only"),
        ("lora_bias", True),
        ("modules_to_save", ["lm_head"]),
        ("use_qalora", True),
        ("alora_invocation_tokens", [5, 6]),
        ("trainable_token_indices", [0, 1]),
        ("layer_replication", [[0, 2], [1, 2]]),
        ("target_parameters", ["mlp.experts.down_proj"]),
        ("use_bdlora", {"target_modules_bd_a": ["q_proj"], "nblocks": 2}),
        ("arrow_config", {"top_k": 2}),
        ("kasa_config", {"beta": 1.0}),
    ],
)
def test_unsupported_config_fields(field, value, plain_copy, arch):
    edit_config(plain_copy, **{field: value})
    with pytest.raises(AdapterError, match=rf"^{field}=.* is not supported"):
        load_peft_adapter(plain_copy, arch, max_rank=8)


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_4", "olora", "corda", "loftq", "lora_ga"])
def test_base_modifying_inits(init, plain_copy, arch):
    edit_config(plain_copy, init_lora_weights=init)
    with pytest.raises(AdapterError, match=f"init_lora_weights='{init}' .* modified base"):
        load_peft_adapter(plain_copy, arch, max_rank=8)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"r": 0}, "r=0 .* must be a positive number"),
        ({"lora_alpha": "8"}, "lora_alpha='8' .* must be a positive number"),
        ({"rank_pattern": ["q_proj"]}, "rank_pattern=.* must be an object"),
        ({"alpha_pattern": {"q_proj": None}}, r"alpha_pattern\['q_proj'\]=None"),
        ({"rank_pattern": {"q_proj(": 4}}, "not a valid regex"),
    ],
)
def test_bad_scaling_fields(changes, message, plain_copy, arch):
    edit_config(plain_copy, **changes)
    with pytest.raises(AdapterError, match=message):
        load_peft_adapter(plain_copy, arch, max_rank=8)


def test_config_rank_disagrees_with_tensors(plain_copy, arch):
    edit_config(plain_copy, r=8)
    with pytest.raises(AdapterError, match="rank 4 in adapter_model.safetensors .* r=8"):
        load_peft_adapter(plain_copy, arch, max_rank=8)


# --- tensors -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "new_name",
    [
        "base_model.model.lm_head.lora_A.weight",
        "base_model.model.model.embed_tokens.lora_embedding_A",
        f"{PREFIX}.0.self_attn.q_proj.lora_magnitude_vector",
        f"{PREFIX}.0.mlp.q_proj.lora_A.weight",
        f"{PREFIX}.0.self_attn.q_proj.lora_A.default.weight",
        "something.else",
    ],
)
def test_unsupported_tensor_names(new_name, plain_copy, arch):
    edit_tensors(plain_copy, lambda t: t.update({new_name: t.pop(Q_A)}))
    with pytest.raises(AdapterError, match="unsupported target module .* q_proj, k_proj"):
        load_peft_adapter(plain_copy, arch, max_rank=8)


def test_layer_out_of_range(plain_copy, arch):
    name = f"{PREFIX}.7.self_attn.q_proj.lora_A.weight"
    edit_tensors(plain_copy, lambda t: t.update({name: t.pop(Q_A)}))
    with pytest.raises(AdapterError, match="is for layer 7 but the base model has 2 layers"):
        load_peft_adapter(plain_copy, arch, max_rank=8)


def test_adapter_for_another_base(make_peft_adapter, tiny_model_factory, arch, tmp_path):
    wider = tiny_model_factory("llama", hidden_size=96)
    folder = make_peft_adapter(wider, tmp_path / "wide", target_modules=("q_proj",))
    with pytest.raises(
        AdapterError, match=r"q_proj\.lora_[AB]\.weight' has shape \[(4, 96|96, 4)\]"
    ):
        load_peft_adapter(folder, arch, max_rank=8)


def test_wrong_out_features(plain_copy, arch):
    edit_tensors(plain_copy, lambda t: t.update({Q_B: torch.zeros(32, 4)}))
    with pytest.raises(AdapterError, match=r"has shape \[32, 4\], expected \[64, r\]"):
        load_peft_adapter(plain_copy, arch, max_rank=8)


@pytest.mark.parametrize(("drop", "missing"), [(Q_B, "lora_B"), (Q_A, "lora_A")])
def test_unpaired_tensor(drop, missing, plain_copy, arch):
    edit_tensors(plain_copy, lambda t: t.pop(drop))
    with pytest.raises(AdapterError, match=f"layers.0.q_proj has .* but no {missing}"):
        load_peft_adapter(plain_copy, arch, max_rank=8)


def test_a_and_b_ranks_differ(plain_copy, arch):
    edit_tensors(plain_copy, lambda t: t.update({Q_B: t[Q_B][:, :3].contiguous()}))
    with pytest.raises(AdapterError, match="rank mismatch: .* rank 4 but .* rank 3"):
        load_peft_adapter(plain_copy, arch, max_rank=8)


def test_rank_above_max(adapters, arch):
    with pytest.raises(
        AdapterError,
        match=r"rank 8 of model\.layers\.0\.self_attn\.q_proj exceeds max_lora_rank 4",
    ):
        load_peft_adapter(adapters["patterns"], arch, max_rank=4)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_values(bad, plain_copy, arch):
    def poison(tensors):
        tensors[Q_B][3, 1] = bad

    edit_tensors(plain_copy, poison)
    with pytest.raises(AdapterError, match=f"'{Q_B}' contains NaN or Inf"):
        load_peft_adapter(plain_copy, arch, max_rank=8)


def test_integer_tensor(plain_copy, arch):
    edit_tensors(plain_copy, lambda t: t.update({Q_A: t[Q_A].to(torch.int32)}))
    with pytest.raises(AdapterError, match="has dtype torch.int32, need floating point"):
        load_peft_adapter(plain_copy, arch, max_rank=8)


def test_no_lora_tensors(plain_copy, arch):
    edit_tensors(plain_copy, lambda t: t.clear())
    with pytest.raises(AdapterError, match="holds no LoRA tensors"):
        load_peft_adapter(plain_copy, arch, max_rank=8)
