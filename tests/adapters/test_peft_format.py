"""PEFT LoRA adapter loading: real PEFT adapters load exactly; broken ones are refused."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from loraplex.adapters.peft_format import (
    SUPPORTED_MODULES,
    AdapterError,
    expected_lora_shapes,
    validate_peft_adapter,
)
from loraplex.adapters.peft_format import load_peft_adapter as engine_load
from loraplex.platform.arch import ModelArch

PREFIX = "base_model.model.model.layers"
Q_A = f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"
Q_B = f"{PREFIX}.0.self_attn.q_proj.lora_B.weight"
PATTERNS = dict(
    rank=4,
    alpha=8.0,
    target_modules=SUPPORTED_MODULES,
    # keys as PEFT users write them: bare suffix, dotted suffix, full name, glob
    rank_pattern={"q_proj": 8, "layers.1.self_attn.v_proj": 2, "model.layers.0.mlp.up_proj": 3},
    alpha_pattern={"v_proj": 4.0, "o_proj": 5.0, "layers.1.mlp.*": 12.0},
)


def load_checked(path, arch, max_rank, name=None, root=None, max_vocab_size=None):
    """The engine's `load_peft_adapter`, once the ingress's `validate_peft_adapter`
    (numpy, no torch) is seen to refuse exactly what it refuses, with the same message:
    every test here checks both."""
    try:
        validate_peft_adapter(path, arch, max_rank, root, max_vocab_size)
    except AdapterError as refused:
        with pytest.raises(AdapterError) as loaded:
            engine_load(path, arch, max_rank, name, root, max_vocab_size)
        assert str(loaded.value) == str(refused)
        raise
    return engine_load(path, arch, max_rank, name, root, max_vocab_size)


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

    adapter = load_checked(adapters[kind], arch, max_rank=8)
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
    plain = load_checked(adapters["plain"], arch, max_rank=8)
    assert plain.name == "plain" and plain.path == adapters["plain"]
    assert plain.target_modules == frozenset(SUPPORTED_MODULES)
    assert len(plain.modules) == arch.num_layers * len(SUPPORTED_MODULES)
    assert plain.rank == 4
    assert plain.num_bytes == sum(4 * (m.a.numel() + m.b.numel()) for m in plain.modules.values())
    assert len(plain.key) == 16 and plain.key_hex == plain.key.hex()
    with pytest.raises(TypeError):
        plain.modules[(0, "q_proj")] = plain.modules[(0, "k_proj")]

    rslora = load_checked(adapters["rslora"], arch, max_rank=4, name="rs")
    assert rslora.name == "rs"
    assert rslora.target_modules == frozenset({"q_proj", "v_proj"})
    assert {m.scaling for m in rslora.modules.values()} == {6.0 / 2.0}

    patterns = load_checked(adapters["patterns"], arch, max_rank=8)
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
    adapter = load_checked(folder, ModelArch.from_folder(base), max_rank=4)
    assert adapter.target_modules == frozenset({"k_proj", "down_proj"})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_tensors_become_float32(dtype, plain_copy, adapters, arch):
    edit_tensors(plain_copy, lambda t: t.update({k: v.to(dtype) for k, v in t.items()}))
    adapter = load_checked(plain_copy, arch, max_rank=8)
    raw = load_file(plain_copy / "adapter_model.safetensors")
    weights = adapter.modules[(0, "q_proj")]
    assert weights.a.dtype == weights.b.dtype == torch.float32
    assert torch.equal(weights.a, raw[Q_A].float())
    assert torch.equal(weights.b, raw[Q_B].float() * 2.0)
    assert adapter.key != load_checked(adapters["plain"], arch, max_rank=8).key


def test_scaled_b_is_torchs_float32_product(adapters, arch):
    """B times its scaling (numpy, at load) is bit for bit torch's float32 product, for
    scalings that are not powers of two (the patterns adapter: 8 / 3 on up_proj)."""
    adapter = load_checked(adapters["patterns"], arch, max_rank=8)
    raw = load_file(adapters["patterns"] / "adapter_model.safetensors")
    assert any(math.log2(m.scaling) % 1 for m in adapter.modules.values())
    for (layer, module), weights in adapter.modules.items():
        parent = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        stored = raw[f"{PREFIX}.{layer}.{parent}.{module}.lora_B.weight"]
        assert torch.equal(weights.b, stored.to(torch.float32) * weights.scaling)


def test_training_only_fields_are_ignored(plain_copy, adapters, arch):
    edit_config(
        plain_copy,
        lora_dropout=0.3,
        init_lora_weights="gaussian",
        target_modules=["q_proj"],
        base_model_name_or_path="somewhere/else",
        inference_mode=False,
    )
    original = load_checked(adapters["plain"], arch, max_rank=8)
    assert load_checked(plain_copy, arch, max_rank=8).key == original.key


# --- identity --------------------------------------------------------------------------


def test_key_ignores_name_and_path(plain_copy, adapters, arch):
    original = load_checked(adapters["plain"], arch, max_rank=8)
    copy = load_checked(plain_copy, arch, max_rank=8, name="someone-else")
    assert copy.key == original.key
    assert (copy.name, copy.path) != (original.name, original.path)


def test_key_changes_with_one_weight(plain_copy, adapters, arch):
    def nudge(tensors):
        tensors[Q_B][0, 0] += 1e-3

    edit_tensors(plain_copy, nudge)
    original = load_checked(adapters["plain"], arch, max_rank=8)
    assert load_checked(plain_copy, arch, max_rank=8).key != original.key


def test_key_changes_with_alpha(plain_copy, adapters, arch):
    edit_config(plain_copy, lora_alpha=16)
    original = load_checked(adapters["plain"], arch, max_rank=8)
    changed = load_checked(plain_copy, arch, max_rank=8)
    assert changed.key != original.key
    assert changed.modules[(0, "q_proj")].scaling == 4.0


# --- directory and files -------------------------------------------------------------


def test_missing_directory(tmp_path, arch):
    with pytest.raises(AdapterError, match="does not exist"):
        load_checked(tmp_path / "nope", arch, max_rank=8)


def test_not_a_directory(tmp_path, arch):
    (tmp_path / "file").write_text("x")
    with pytest.raises(AdapterError, match="is not a directory"):
        load_checked(tmp_path / "file", arch, max_rank=8)


def test_missing_config(plain_copy, arch):
    (plain_copy / "adapter_config.json").unlink()
    with pytest.raises(AdapterError, match="adapter_config.json is missing"):
        load_checked(plain_copy, arch, max_rank=8)


def test_config_not_json(plain_copy, arch):
    (plain_copy / "adapter_config.json").write_text("{'r': 4,")
    with pytest.raises(AdapterError, match="is not valid JSON"):
        load_checked(plain_copy, arch, max_rank=8)


def test_config_not_an_object(plain_copy, arch):
    (plain_copy / "adapter_config.json").write_text("[1, 2]")
    with pytest.raises(AdapterError, match="must hold a JSON object, got list"):
        load_checked(plain_copy, arch, max_rank=8)


def test_missing_safetensors(plain_copy, arch):
    (plain_copy / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="adapter_model.safetensors is missing"):
        load_checked(plain_copy, arch, max_rank=8)


def test_pickled_bin_only(plain_copy, arch):
    (plain_copy / "adapter_model.safetensors").rename(plain_copy / "adapter_model.bin")
    with pytest.raises(AdapterError, match=r"pickled \.bin adapters are not supported, convert"):
        load_checked(plain_copy, arch, max_rank=8)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors(damage, plain_copy, arch):
    file = plain_copy / "adapter_model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 100] if damage == "truncate" else b"\x07" * 64)
    with pytest.raises(AdapterError, match="corrupt or truncated"):
        load_checked(plain_copy, arch, max_rank=8)


# --- config --------------------------------------------------------------------------


@pytest.mark.parametrize("peft_type", ["LOHA", "IA3", "PREFIX_TUNING", None])
def test_other_peft_types(peft_type, plain_copy, arch):
    edit_config(plain_copy, peft_type=peft_type)
    with pytest.raises(AdapterError, match=f"peft_type {peft_type!r} is not supported"):
        load_checked(plain_copy, arch, max_rank=8)


def test_dora_saved_by_peft(base, arch, tmp_path):
    folder = save_peft_config_adapter(base, tmp_path / "dora", use_dora=True)
    with pytest.raises(AdapterError, match="DoRA is not supported"):
        load_checked(folder, arch, max_rank=8)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("fan_in_fan_out", True),
        ("bias", "all"),
        ("bias", "lora_only"),
        ("lora_bias", True),
        ("modules_to_save", ["score"]),
        ("modules_to_save", "lm_head"),
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
        load_checked(plain_copy, arch, max_rank=8)


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_4", "olora", "corda", "loftq", "lora_ga"])
def test_base_modifying_inits(init, plain_copy, arch):
    edit_config(plain_copy, init_lora_weights=init)
    with pytest.raises(AdapterError, match=f"init_lora_weights='{init}' .* modified base"):
        load_checked(plain_copy, arch, max_rank=8)


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
        load_checked(plain_copy, arch, max_rank=8)


def test_config_rank_disagrees_with_tensors(plain_copy, arch):
    edit_config(plain_copy, r=8)
    with pytest.raises(AdapterError, match="rank 4 in adapter_model.safetensors .* r=8"):
        load_checked(plain_copy, arch, max_rank=8)


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
        load_checked(plain_copy, arch, max_rank=8)


def test_layer_out_of_range(plain_copy, arch):
    name = f"{PREFIX}.7.self_attn.q_proj.lora_A.weight"
    edit_tensors(plain_copy, lambda t: t.update({name: t.pop(Q_A)}))
    with pytest.raises(AdapterError, match="is for layer 7 but the base model has 2 layers"):
        load_checked(plain_copy, arch, max_rank=8)


def test_adapter_for_another_base(make_peft_adapter, tiny_model_factory, arch, tmp_path):
    wider = tiny_model_factory("llama", hidden_size=96)
    folder = make_peft_adapter(wider, tmp_path / "wide", target_modules=("q_proj",))
    with pytest.raises(
        AdapterError, match=r"q_proj\.lora_[AB]\.weight' has shape \[(4, 96|96, 4)\]"
    ):
        load_checked(folder, arch, max_rank=8)


def test_wrong_out_features(plain_copy, arch):
    edit_tensors(plain_copy, lambda t: t.update({Q_B: torch.zeros(32, 4)}))
    with pytest.raises(AdapterError, match=r"has shape \[32, 4\], expected \[64, r\]"):
        load_checked(plain_copy, arch, max_rank=8)


@pytest.mark.parametrize(("drop", "missing"), [(Q_B, "lora_B"), (Q_A, "lora_A")])
def test_unpaired_tensor(drop, missing, plain_copy, arch):
    edit_tensors(plain_copy, lambda t: t.pop(drop))
    with pytest.raises(AdapterError, match=f"layers.0.q_proj has .* but no {missing}"):
        load_checked(plain_copy, arch, max_rank=8)


def test_a_and_b_ranks_differ(plain_copy, arch):
    edit_tensors(plain_copy, lambda t: t.update({Q_B: t[Q_B][:, :3].contiguous()}))
    with pytest.raises(AdapterError, match="rank mismatch: .* rank 4 but .* rank 3"):
        load_checked(plain_copy, arch, max_rank=8)


def test_rank_above_max(adapters, arch):
    with pytest.raises(
        AdapterError,
        match=r"rank 8 of model\.layers\.0\.self_attn\.q_proj exceeds max_lora_rank 4",
    ):
        load_checked(adapters["patterns"], arch, max_rank=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values(bad, dtype, plain_copy, arch):
    def poison(tensors):
        tensors[Q_B] = tensors[Q_B].to(dtype)
        tensors[Q_B][3, 1] = bad

    edit_tensors(plain_copy, poison)
    with pytest.raises(AdapterError, match=f"'{Q_B}' contains NaN or Inf"):
        load_checked(plain_copy, arch, max_rank=8)


def test_integer_tensor(plain_copy, arch):
    edit_tensors(plain_copy, lambda t: t.update({Q_A: t[Q_A].to(torch.int32)}))
    with pytest.raises(AdapterError, match="has dtype torch.int32, need floating point"):
        load_checked(plain_copy, arch, max_rank=8)


def test_no_lora_tensors(plain_copy, arch):
    edit_tensors(plain_copy, lambda t: t.clear())
    with pytest.raises(AdapterError, match="holds no LoRA tensors"):
        load_checked(plain_copy, arch, max_rank=8)


# --- hostile configs: types, ranges, strict JSON -------------------------------------


def write_config_literal(folder: Path, field: str, literal: str) -> None:
    """Sets `field` to a raw JSON literal (1e400, NaN...) that json.dumps cannot write."""
    config = json.loads((folder / "adapter_config.json").read_text())
    config.pop(field, None)
    text = json.dumps(config)
    (folder / "adapter_config.json").write_text(f'{text[:-1]}, "{field}": {literal}}}')


@pytest.mark.parametrize(
    ("field", "literal", "message"),
    [
        ("lora_alpha", "1e400", "not valid JSON: '1e400' overflows to inf"),
        ("lora_alpha", "-1e400", "not valid JSON: '-1e400' overflows to -inf"),
        ("lora_alpha", "NaN", "not valid JSON: NaN is not a finite number"),
        ("lora_alpha", "Infinity", "not valid JSON: Infinity is not a finite number"),
        ("lora_alpha", "-Infinity", "not valid JSON: -Infinity is not a finite number"),
        ("lora_alpha", "-1", "lora_alpha=-1 .* must be a positive number: finite and > 0"),
        ("lora_alpha", "0", "lora_alpha=0 .* must be a positive number"),
        ("lora_alpha", "0.0", "lora_alpha=0.0 .* must be a positive number"),
        ("lora_alpha", '"8"', "lora_alpha='8' .* must be a positive number"),
        ("lora_alpha", "true", "lora_alpha=True .* must be a positive number"),
        ("lora_alpha", "null", "lora_alpha=None .* must be a positive number"),
        ("lora_alpha", "1" + "0" * 400, "lora_alpha=1000.* must be a positive number: finite"),
        ("lora_alpha", "1" + "0" * 5000, "not valid JSON: .*integer string conversion"),
        ("r", "0", "r=0 .* must be a positive number: an integer rank >= 1"),
        ("r", "8.5", "r=8.5 .* an integer rank >= 1"),
        ("r", "4.0", "r=4.0 .* an integer rank >= 1"),
        ("r", "true", "r=True .* an integer rank >= 1"),
        ("r", '"8"', "r='8' .* an integer rank >= 1"),
        ("r", "[4]", r"r=\[4\] .* an integer rank >= 1"),
        ("rank_pattern", '{"q_proj": 0}', r"rank_pattern\['q_proj'\]=0 .* an integer rank"),
        ("rank_pattern", '{"q_proj": 1.5}', r"rank_pattern\['q_proj'\]=1.5 .* an integer rank"),
        ("rank_pattern", "[]", r"rank_pattern=\[\] .* must be an object"),
        ("alpha_pattern", '{"q_proj": Infinity}', "not valid JSON: Infinity is not a finite"),
        ("alpha_pattern", '{"q_proj": 1e999}', "not valid JSON: '1e999' overflows to inf"),
        ("alpha_pattern", '{"q_proj": -2}', r"alpha_pattern\['q_proj'\]=-2 .* finite and > 0"),
        ("alpha_pattern", '{"": 2}', "alpha_pattern key '' .* must be 1 to 256 characters"),
        ("alpha_pattern", '{"' + "a" * 257 + '": 2}', "must be 1 to 256 characters"),
        ("use_rslora", '"yes"', "use_rslora='yes' .* must be true or false"),
        ("use_rslora", "1", "use_rslora=1 .* must be true or false"),
        ("lora_dropout", "[" * 100_000 + "]" * 100_000, "not valid JSON: nested too deeply"),
    ],
)
def test_config_values_out_of_range(field, literal, message, plain_copy, arch):
    write_config_literal(plain_copy, field, literal)
    with pytest.raises(AdapterError, match=message):
        load_checked(plain_copy, arch, max_rank=8)


def test_too_many_pattern_keys(plain_copy, arch):
    edit_config(plain_copy, rank_pattern={f"layers.{i}.q_proj": 4 for i in range(1025)})
    with pytest.raises(AdapterError, match="rank_pattern .* has 1025 keys, over the limit of 1024"):
        load_checked(plain_copy, arch, max_rank=8)


def test_oversized_config_is_refused(plain_copy, arch):
    edit_config(plain_copy, padding="x" * (1 << 20))
    with pytest.raises(AdapterError, match="adapter_config.json .* over the 1048576-byte limit"):
        load_checked(plain_copy, arch, max_rank=8)


@pytest.mark.parametrize(("alpha", "b_factor"), [(1e38, 1e3), (1e300, 1.0)])
def test_scaling_that_overflows_b_is_refused(alpha, b_factor, plain_copy, arch):
    edit_config(plain_copy, lora_alpha=alpha)
    edit_tensors(plain_copy, lambda t: t.update({Q_B: t[Q_B] * b_factor}))
    with pytest.raises(AdapterError, match=f"tensor '{Q_B}' times its scaling .* overflows"):
        load_checked(plain_copy, arch, max_rank=8)


def test_tiny_alpha_loads_finite(plain_copy, arch):
    edit_config(plain_copy, lora_alpha=5e-324)
    adapter = load_checked(plain_copy, arch, max_rank=8)
    assert all(torch.isfinite(m.b).all() for m in adapter.modules.values())


# --- pattern keys: suffixes and globs, never regexes ---------------------------------


@pytest.mark.parametrize("field", ["rank_pattern", "alpha_pattern"])
@pytest.mark.parametrize("key", ["(.*.*)*!", "(.*.*)*!" + "a" * 40, "(a|aa)*$" * 8])
def test_backtracking_regex_key_is_refused_fast(field, key, plain_copy, arch):
    edit_config(plain_copy, **{field: {key: 4}})
    started = time.monotonic()
    with pytest.raises(AdapterError, match="not regular expressions"):
        load_checked(plain_copy, arch, max_rank=8)
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize("char", list("\\(){}+^$|"))
def test_regex_only_syntax_is_refused(char, plain_copy, arch):
    edit_config(plain_copy, alpha_pattern={f"q{char}proj": 4.0})
    with pytest.raises(AdapterError, match=r"pattern keys are module-name suffixes or globs"):
        load_checked(plain_copy, arch, max_rank=8)


def test_the_largest_glob_keys_cost_little(plain_copy, arch):
    """1024 keys of 256 characters, 126 wildcards each, in both patterns: parsing them
    (adapters/module_globs.py, no regex compiled) is Python-level work, well under a
    second on this VM's core; fnmatch's regexes took 4-5 s to compile, and a
    backtracking regex would take minutes. Matching them is linear."""
    keys = {"*a" * 125 + f"*{i:05d}": 3.0 for i in range(1023)}  # 256 characters each
    edit_config(
        plain_copy,
        alpha_pattern={**keys, "*": 2.0},
        rank_pattern={**dict.fromkeys(keys, 8), "*": 4},
    )
    started = time.monotonic()
    validate_peft_adapter(plain_copy, arch, max_rank=8)
    assert time.monotonic() - started < 10.0
    started = time.monotonic()
    adapter = engine_load(plain_copy, arch, max_rank=8)
    assert time.monotonic() - started < 10.0
    assert {m.scaling for m in adapter.modules.values()} == {2.0 / 4}


ORACLE_KEY_SETS = [
    ["model.layers.0.self_attn.q_proj"],
    ["q_proj"],
    ["layers.1.mlp.down_proj"],
    ["layers.*.q_proj"],
    ["self_attn.q_proj", "q_proj"],
    ["q_proj", "layers.0.self_attn.q_proj"],
    ["layers.0.self_attn.q_proj", "q_proj", "k_proj"],
    ["mlp.down_proj", "down_proj", "model.layers.1.mlp.up_proj"],
    ["layers.1.*", "o_proj", "v_proj"],
    ["up_proj", "gate_proj", "layers.0.mlp.up_proj"],
    ["layers.*.mlp.*", "layers.0.self_attn.*"],
    ["model.layers.1.self_attn.k_proj", "lm_head", "proj", "layers.1"],
]


@pytest.mark.parametrize("keys", ORACLE_KEY_SETS, ids=lambda keys: ",".join(keys))
def test_pattern_keys_pick_what_peft_picks(keys, plain_copy, arch):
    """Oracle: for every module of the tiny model, the alpha chosen is the one PEFT's own
    get_pattern_key (its regex rule) picks for keys PEFT users write."""
    from peft.utils.other import get_pattern_key

    pattern = {key: float(10 + i) for i, key in enumerate(keys)}
    edit_config(plain_copy, lora_alpha=8.0, alpha_pattern=pattern)
    adapter = load_checked(plain_copy, arch, max_rank=8)
    assert len(adapter.modules) == arch.num_layers * len(SUPPORTED_MODULES)
    for (layer, module), weights in adapter.modules.items():
        parent = "self_attn" if module in SUPPORTED_MODULES[:4] else "mlp"
        module_key = f"model.layers.{layer}.{parent}.{module}"
        expected = pattern.get(get_pattern_key(pattern.keys(), module_key), 8.0)
        assert weights.scaling == expected / 4, module_key


# --- hostile safetensors: header checked before any tensor byte is read ----------------


def read_safetensors(file: Path) -> tuple[dict, bytes]:
    raw = file.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def write_safetensors(file: Path, header: dict | bytes, data: bytes) -> None:
    encoded = header if isinstance(header, bytes) else json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def by_offset(header: dict) -> list[str]:
    names = [n for n in header if n != "__metadata__"]
    return sorted(names, key=lambda n: header[n]["data_offsets"])


def _header_too_long(header, data):
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", 8 + len(encoded) + len(data) + 1) + encoded + data


def _offsets_overlap(header, data):
    first, second = by_offset(header)[:2]
    header[second]["data_offsets"][0] -= 4
    header[second]["data_offsets"][1] -= 4
    return header, data


def _offsets_gap(header, data):
    last = by_offset(header)[-1]
    begin, end = header[last]["data_offsets"]
    header[last]["data_offsets"] = [begin + 4, end + 4]
    return header, data[:begin] + b"\0" * 4 + data[begin:]


def _dtype_size_mismatch(header, data):
    header[Q_A]["dtype"] = "F16"
    return header, data


def _shape_size_mismatch(header, data):
    header[Q_A]["shape"] = [5, 64]
    return header, data


def _nan_in_header(header, data):
    header[Q_A]["shape"] = [float("nan"), 64]
    return header, data


def _duplicate_name(header, data):
    encoded = json.dumps(header).encode()
    duplicate = json.dumps({Q_A: header[Q_A]}).encode()[1:-1]
    return encoded[:-1] + b", " + duplicate + b"}", data


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_header_too_long, "header length .* exceeds the file size"),
        (_offsets_overlap, "an overlap with tensor"),
        (_offsets_gap, "a gap before tensor"),
        (_dtype_size_mismatch, "which do not hold its size"),
        (_shape_size_mismatch, "which do not hold its size"),
        (_nan_in_header, "header is not valid JSON: NaN is not a finite number"),
        (_duplicate_name, "header is not valid JSON: duplicate key"),
        (lambda h, d: (b"{not json" + b" " * 40, d), "header is not valid JSON"),
        (lambda h, d: (b"[]", d), "header is a JSON list, not an object"),
        (lambda h, d: (b"[" * 100_000, d), "header is not valid JSON: nested too deeply"),
        (lambda h, d: (h, d + b"\0"), r"the tensors take \d+ bytes but the data region"),
        (lambda h, d: ({**h, "__metadata__": {"format": 1}}, d), "__metadata__ must map"),
        (lambda h, d: ({**h, Q_A: {**h[Q_A], "extra": 1}}, d), "must have exactly"),
        (lambda h, d: ({**h, Q_A: {**h[Q_A], "shape": [4, -64]}}, d), "has shape"),
        (lambda h, d: ({**h, Q_A: {**h[Q_A], "data_offsets": [0]}}, d), "has data_offsets"),
        (lambda h, d: ({**h, Q_A: {**h[Q_A], "dtype": 4}}, d), "has dtype 4"),
        (lambda h, d: b"\x07" * 16, "over the 16777216-byte limit"),
    ],
)
def test_corrupt_safetensors_header(damage, message, plain_copy, arch):
    file = plain_copy / "adapter_model.safetensors"
    header, data = read_safetensors(file)
    damaged = damage(header, data)
    if isinstance(damaged, bytes):
        file.write_bytes(damaged)
    else:
        write_safetensors(file, *damaged)
    with pytest.raises(AdapterError, match=f"corrupt or truncated: .*{message}"):
        load_checked(plain_copy, arch, max_rank=8)


def test_file_shorter_than_header_length(plain_copy, arch):
    (plain_copy / "adapter_model.safetensors").write_bytes(b"\x01\x00")
    with pytest.raises(AdapterError, match="corrupt or truncated: 2 bytes, shorter than"):
        load_checked(plain_copy, arch, max_rank=8)


@pytest.mark.parametrize(("dtype", "torch_name"), [("F64", "float64"), ("I64", "int64")])
def test_unservable_dtypes(dtype, torch_name, plain_copy, arch):
    file = plain_copy / "adapter_model.safetensors"
    header, data = read_safetensors(file)
    header[Q_A]["dtype"] = dtype
    header[Q_A]["shape"] = [2, 64]  # same byte size as the [4, 64] float32 tensor
    write_safetensors(file, header, data)
    with pytest.raises(AdapterError, match=f"has dtype torch.{torch_name}, need floating point"):
        load_checked(plain_copy, arch, max_rank=8)


def test_unknown_dtype(plain_copy, arch):
    file = plain_copy / "adapter_model.safetensors"
    header, data = read_safetensors(file)
    header[Q_A]["dtype"] = "F4"
    write_safetensors(file, header, data)
    with pytest.raises(AdapterError, match="has dtype 'F4', need floating point"):
        load_checked(plain_copy, arch, max_rank=8)


_MEASURE_LOADS = """
import json, resource, sys
from loraplex.adapters.peft_format import AdapterError, load_peft_adapter, validate_peft_adapter
from loraplex.platform.arch import ModelArch

def proc_value(file, field):
    with open(file) as lines:
        return next(int(line.split()[1]) for line in lines if line.startswith(field))

def bytes_read():
    return proc_value("/proc/self/io", "rchar:")

def peak_mapped():
    return proc_value("/proc/self/status", "VmPeak:") * 1024

arch = ModelArch.from_folder(sys.argv[1])
readers = (validate_peft_adapter, load_peft_adapter)
for reader in readers:
    reader(sys.argv[2], arch, 8)  # warm up lazy imports and allocations
results = []
for folder, reader in [(folder, reader) for folder in sys.argv[3:] for reader in readers]:
    rss, read, mapped = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, bytes_read(), peak_mapped()
    try:
        reader(folder, arch, 8)
        outcome = "loaded"
    except AdapterError as err:
        outcome = str(err)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) * 1024
    read, mapped = bytes_read() - read, peak_mapped() - mapped
    results.append({"outcome": outcome, "rss": grown, "read": read, "mapped": mapped})
print(json.dumps(results))
"""


def test_oversized_safetensors_is_refused_without_reading_it(adapters, base, tmp_path):
    """A valid file with 4 GiB of sparse trailing bytes, and a header declaring 1 GiB of
    rank-2**21 tensors: both refused, in a child whose peak RSS, bytes read (rchar) and
    peak mapped memory (VmPeak) stay small, so the test fails if the loader read either
    file or mapped it whole (as safe_open does)."""
    trailing = Path(shutil.copytree(adapters["plain"], tmp_path / "trailing"))
    with open(trailing / "adapter_model.safetensors", "r+b") as out:
        out.truncate(4 << 30)
    declared = Path(shutil.copytree(adapters["plain"], tmp_path / "declared"))
    rows = 1 << 21
    q_b = Q_A.replace("lora_A", "lora_B")
    nbytes = rows * 64 * 4
    header = {
        Q_A: {"dtype": "F32", "shape": [rows, 64], "data_offsets": [0, nbytes]},
        q_b: {"dtype": "F32", "shape": [64, rows], "data_offsets": [nbytes, 2 * nbytes]},
    }
    encoded = json.dumps(header).encode()
    with open(declared / "adapter_model.safetensors", "wb") as out:
        out.write(struct.pack("<Q", len(encoded)) + encoded)
        out.truncate(8 + len(encoded) + 2 * nbytes)
    child = subprocess.run(
        [sys.executable, "-c", _MEASURE_LOADS, base, adapters["plain"], trailing, declared],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr
    results = json.loads(child.stdout)
    assert len(results) == 4  # each file through validate_peft_adapter and load_peft_adapter
    for result in results[:2]:
        assert "corrupt or truncated: the tensors take" in result["outcome"]
    for result in results[2:]:
        assert f"rank {rows} of model.layers.0.self_attn.q_proj exceeds" in result["outcome"]
    for result in results:
        assert result["rss"] < 200 << 20, result
        assert result["read"] < 1 << 20, result
        assert result["mapped"] < 512 << 20, result


# --- tenant roots: no symbolic links, nothing outside the root ------------------------


@pytest.fixture
def tenant_root(adapters, tmp_path) -> Path:
    """root/acme/own (a real adapter) and root/acme/other, plus a secret outside root."""
    root = tmp_path / "root"
    shutil.copytree(adapters["plain"], root / "acme" / "own")
    shutil.copytree(adapters["rslora"], root / "acme" / "other")
    shutil.copytree(adapters["plain"], tmp_path / "secret")
    return root


def test_root_loads_the_same_adapter(tenant_root, arch, monkeypatch):
    folder = tenant_root / "acme" / "own"
    contained = load_checked(folder, arch, 8, root=tenant_root)
    free = load_checked(folder, arch, 8)
    assert contained.key == free.key and contained.path == folder
    assert contained.modules.keys() == free.modules.keys()
    for key, weights in contained.modules.items():
        assert torch.equal(weights.a, free.modules[key].a)
        assert torch.equal(weights.b, free.modules[key].b)
    monkeypatch.chdir(tenant_root.parent)
    assert load_checked("root/acme/own", arch, 8, root="root").key == free.key
    assert load_checked(folder, arch, 8, root="./root/").key == free.key


@pytest.mark.parametrize("file", ["adapter_model.safetensors", "adapter_config.json"])
@pytest.mark.parametrize("target", ["inside", "outside"])
def test_root_refuses_a_linked_file(file, target, tenant_root, arch):
    folder = tenant_root / "acme" / "own"
    source = tenant_root / "acme" / "other" if target == "inside" else tenant_root.parent / "secret"
    (folder / file).unlink()
    (folder / file).symlink_to(source / file)
    with pytest.raises(AdapterError, match=f"'{file}' is a symbolic link; tenant adapter files"):
        load_checked(folder, arch, 8, root=tenant_root)
    assert load_checked(folder, arch, 8).key  # the operator's own loads follow links


@pytest.mark.parametrize("target", ["inside", "outside"])
def test_root_refuses_a_linked_folder(target, tenant_root, arch):
    source = tenant_root / "acme" / "other" if target == "inside" else tenant_root.parent / "secret"
    (tenant_root / "acme" / "link").symlink_to(source, target_is_directory=True)
    with pytest.raises(AdapterError, match="folder 'link' is a symbolic link"):
        load_checked(tenant_root / "acme" / "link", arch, 8, root=tenant_root)


def test_root_refuses_a_linked_parent_folder(tenant_root, arch):
    (tenant_root / "linked").symlink_to(tenant_root / "acme", target_is_directory=True)
    with pytest.raises(AdapterError, match="folder 'linked' is a symbolic link"):
        load_checked(tenant_root / "linked" / "own", arch, 8, root=tenant_root)


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("acme/../acme/own", "contains '..'"),
        ("acme/own/..", "contains '..'"),
        ("", "is the root .* itself"),
        (".", "is the root .* itself"),
        ("../secret", "contains '..'"),
    ],
)
def test_root_refuses_paths_not_strictly_inside(where, message, tenant_root, arch):
    with pytest.raises(AdapterError, match=message):
        load_checked(f"{tenant_root}/{where}", arch, 8, root=tenant_root)


def test_root_refuses_a_path_outside(tenant_root, arch):
    with pytest.raises(AdapterError, match="is not inside"):
        load_checked(tenant_root.parent / "secret", arch, 8, root=tenant_root)


def test_root_missing_folder_and_file(tenant_root, arch):
    with pytest.raises(AdapterError, match="does not exist"):
        load_checked(tenant_root / "acme" / "nope", arch, 8, root=tenant_root)
    with pytest.raises(AdapterError, match="is not a directory"):
        load_checked(
            tenant_root / "acme" / "own" / "adapter_config.json", arch, 8, root=tenant_root
        )
    folder = tenant_root / "acme" / "own"
    (folder / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="adapter_model.safetensors is missing"):
        load_checked(folder, arch, 8, root=tenant_root)


@pytest.mark.parametrize("root", [True, False])
def test_a_fifo_is_refused_without_waiting(root, tenant_root, arch):
    folder = tenant_root / "acme" / "own"
    (folder / "adapter_config.json").unlink()
    os.mkfifo(folder / "adapter_config.json")
    started = time.monotonic()
    with pytest.raises(AdapterError, match="adapter_config.json is not a regular file"):
        load_checked(folder, arch, 8, root=tenant_root if root else None)
    assert time.monotonic() - started < 1.0


# --- property: any config either loads finite weights or is refused, fast ---------------

_RAW_LITERALS = {"@1e400@": "1e400", "@-1e400@": "-1e400", "@bigint@": "1" + "0" * 5000}
_VALUE = st.one_of(
    st.integers(-3, 12),
    st.integers(),
    st.integers(min_value=10**300, max_value=10**400),
    st.floats(),
    st.floats(min_value=1e-320, max_value=1e308),
    st.booleans(),
    st.none(),
    st.text(max_size=5),
    st.lists(st.integers(), max_size=3),
    st.sampled_from(sorted(_RAW_LITERALS)),
)
_KEY = st.one_of(
    st.sampled_from(
        ["q_proj", "v_proj", "self_attn.q_proj", "layers.1.mlp.down_proj", "model.layers.0"]
    ),
    st.sampled_from(["layers.*.q_proj", "*", "?_proj", "[qk]_proj", "[", "]", "[!a-"]),
    st.sampled_from(["(.*.*)*!", "q_proj|v_proj", "^q", "a{2}", "\\d", "[a-z]+_proj", "$"]),
    st.text(max_size=12),
    st.text(alphabet="*?[]!.a_", max_size=300),
)
_ALPHA = st.one_of(st.floats(min_value=1e-30, max_value=1e300), st.integers(1, 10**300))


def _mostly(valid: st.SearchStrategy) -> st.SearchStrategy:
    """9 draws in 10 from `valid`, else any value, so that all fields of a draw are
    valid often enough for loads to succeed too."""
    return st.integers(0, 9).flatmap(lambda n: valid if n else _VALUE)


_CONFIG = {
    "r": _mostly(st.just(4)),
    "lora_alpha": _mostly(_ALPHA),
    "use_rslora": _mostly(st.one_of(st.booleans(), st.none())),
    "rank_pattern": _mostly(st.dictionaries(_KEY, _mostly(st.just(4)), max_size=6)),
    "alpha_pattern": _mostly(st.dictionaries(_KEY, _mostly(_ALPHA), max_size=6)),
}


@pytest.fixture(scope="module")
def fuzz_folder(adapters, tmp_path_factory) -> Path:
    return Path(shutil.copytree(adapters["plain"], tmp_path_factory.mktemp("fuzz") / "a"))


@settings(max_examples=60, deadline=None)
@given(changes=st.fixed_dictionaries({}, optional=_CONFIG))
def test_any_config_loads_finite_or_is_refused(changes, fuzz_folder, adapters, arch):
    config = json.loads((adapters["plain"] / "adapter_config.json").read_text())
    text = json.dumps({**config, **changes}, allow_nan=True)
    for placeholder, literal in _RAW_LITERALS.items():
        text = text.replace(json.dumps(placeholder), literal)
    (fuzz_folder / "adapter_config.json").write_text(text)
    started = time.monotonic()
    try:
        adapter = load_checked(fuzz_folder, arch, max_rank=8)
    except AdapterError:
        pass
    else:
        for weights in adapter.modules.values():
            assert torch.isfinite(weights.a).all() and torch.isfinite(weights.b).all()
            assert math.isfinite(weights.scaling)
    assert time.monotonic() - started < 1.0


# --- modules_to_save: the adapter's own lm_head and embed_tokens ------------------------

EMBED = "base_model.model.model.embed_tokens.weight"
HEAD = "base_model.model.lm_head.weight"


@pytest.fixture(scope="session")
def saved_adapters(make_peft_adapter, base, tmp_path_factory) -> dict[str, Path]:
    """Real PEFT adapters with saved modules: both at the base's vocabulary, and both
    over a vocabulary resized to 520 (with its tokenizer)."""
    root = tmp_path_factory.mktemp("saved-modules")
    both = ("lm_head", "embed_tokens")
    return {
        "both": make_peft_adapter(base, root / "both", modules_to_save=both, seed=5),
        "resized": make_peft_adapter(
            base, root / "resized", modules_to_save=both, vocab_size=520, seed=6
        ),
    }


@pytest.fixture
def saved_copy(saved_adapters, tmp_path) -> Path:
    return Path(shutil.copytree(saved_adapters["both"], tmp_path / "saved"))


@pytest.fixture
def resized_copy(saved_adapters, tmp_path) -> Path:
    return Path(shutil.copytree(saved_adapters["resized"], tmp_path / "resized"))


def test_saved_modules_load_as_peft_saved_them(saved_adapters, arch):
    adapter = load_checked(saved_adapters["both"], arch, max_rank=8)
    stored = load_file(saved_adapters["both"] / "adapter_model.safetensors")
    assert set(adapter.saved_modules) == {"lm_head", "embed_tokens"}
    assert torch.equal(adapter.saved_modules["lm_head"], stored[HEAD])
    assert torch.equal(adapter.saved_modules["embed_tokens"], stored[EMBED])
    assert adapter.vocab_size == arch.vocab_size and adapter.tokenizer is None
    pairs = sum(t.numel() * 4 for m in adapter.modules.values() for t in (m.a, m.b))
    assert adapter.num_bytes == pairs + 2 * arch.vocab_size * arch.hidden_size * 4


def test_a_resized_vocabulary_loads_within_the_cap_with_its_tokenizer(saved_adapters, arch):
    folder = saved_adapters["resized"]
    with pytest.raises(AdapterError, match=r"vocabulary of 520 tokens; this model serves 512"):
        load_checked(folder, arch, max_rank=8)
    with pytest.raises(AdapterError, match=r"serves 512 to 516"):
        load_checked(folder, arch, max_rank=8, max_vocab_size=516)
    adapter = load_checked(folder, arch, max_rank=8, max_vocab_size=520)
    assert adapter.vocab_size == 520
    assert adapter.tokenizer.decode([519]) == "w519"


def test_a_saved_module_key_changes_with_its_values(saved_copy, saved_adapters, arch):
    before = load_checked(saved_adapters["both"], arch, max_rank=8).key
    edit_tensors(saved_copy, lambda t: t[HEAD].__setitem__((3, 5), t[HEAD][3, 5] + 1.0))
    assert load_checked(saved_copy, arch, max_rank=8).key != before


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda f: edit_tensors(
                f, lambda t: t.__setitem__(f"{HEAD[:-7]}.modules_to_save.weight", t[HEAD] + 1)
            ),
            "modules_to_save.weight' does not repeat",
        ),
        (
            lambda f: edit_tensors(f, lambda t: t.__setitem__(HEAD, t[HEAD][:, :8].clone())),
            r"shape \[512, 8\], expected \[vocab, 64\]",
        ),
        (
            lambda f: edit_tensors(f, lambda t: t.__setitem__(HEAD, t[HEAD][:500].clone())),
            "different vocabularies",
        ),
        (
            lambda f: edit_tensors(
                f, lambda t: [t.__setitem__(k, t[k][:500].clone()) for k in (HEAD, EMBED)]
            ),
            "vocabulary of 500 tokens",
        ),
        (
            lambda f: edit_tensors(f, lambda t: t[EMBED].__setitem__((0, 0), math.nan)),
            "embed_tokens.weight' contains NaN",
        ),
        (
            lambda f: edit_tensors(f, lambda t: t.__setitem__(HEAD, t[HEAD].to(torch.int32))),
            "lm_head.weight' has dtype torch.int32",
        ),
    ],
    ids=["copy", "hidden", "mismatched", "smaller", "nan", "int"],
)
def test_broken_saved_modules_are_refused(edit, message, saved_copy, arch):
    edit(saved_copy)
    with pytest.raises(AdapterError, match=message):
        load_checked(saved_copy, arch, max_rank=8, max_vocab_size=600)


def test_a_resized_vocabulary_needs_both_modules_and_a_fitting_tokenizer(resized_copy, arch):
    edit_tensors(resized_copy, lambda t: [t.pop(k) for k in list(t) if "embed_tokens" in k])
    edit_config(resized_copy, modules_to_save=["lm_head"])
    with pytest.raises(AdapterError, match="needs the adapter's own embed_tokens and lm_head"):
        load_checked(resized_copy, arch, max_rank=8, max_vocab_size=520)


def test_a_resized_vocabulary_without_a_fitting_tokenizer_is_refused(
    resized_copy, base, tmp_path, arch
):
    tokenizer = resized_copy / "tokenizer.json"
    kept = tokenizer.read_bytes()
    tokenizer.unlink()
    with pytest.raises(AdapterError, match="ships no tokenizer.json"):
        load_checked(resized_copy, arch, max_rank=8, max_vocab_size=520)
    tokenizer.write_bytes(b"{not json")
    with pytest.raises(AdapterError, match="tokenizer.json .* cannot be read"):
        load_checked(resized_copy, arch, max_rank=8, max_vocab_size=520)
    tokenizer.write_bytes(kept)
    edit_tensors(
        resized_copy, lambda t: [t.__setitem__(k, t[k][:516].clone()) for k in t if "lora" not in k]
    )
    with pytest.raises(AdapterError, match="has 520 tokens, more than the 516 rows"):
        load_checked(resized_copy, arch, max_rank=8, max_vocab_size=520)


def test_a_linked_tokenizer_is_refused_under_a_root(resized_copy, saved_adapters, arch):
    """Another folder's tokenizer reached by a link is never read for a tenant."""
    tokenizer = resized_copy / "tokenizer.json"
    tokenizer.unlink()
    tokenizer.symlink_to(saved_adapters["resized"] / "tokenizer.json")
    with pytest.raises(AdapterError, match="cannot read tokenizer.json"):
        load_checked(resized_copy, arch, max_rank=8, root=resized_copy.parent, max_vocab_size=520)
