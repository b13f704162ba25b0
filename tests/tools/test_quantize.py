"""`loraplex quantize` writes compressed-tensors checkpoints that the engine loads as
stored (platform/models/compressed_tensors.py): int8 W8A8 and W8A16 and int4 W4A16
(per group, ragged groups, per channel, with zero points); the stored values are the
projections' own, and the answers of the base model and a PEFT adapter on it stay
within the tolerance of transformers + PEFT on the dequantized weights. Configs the
engine cannot serve exactly are refused by name."""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.kernels.int4_matmul import Int4Weight, unpack_int4
from loraplex.kernels.int8_matmul import Int8Weight
from loraplex.kernels.int_packing import unpack_ints
from loraplex.platform.llm import LLM
from loraplex.platform.models.compressed_tensors import (
    INT4_MODE,
    Int4Scheme,
    read_checkpoint_quantization,
    read_int4_scheme,
)
from loraplex.platform.request import SamplingParams
from loraplex.tools.cli import main as cli_main
from loraplex.tools.quantize import quantize_folder

MAX_LOGPROB_ERROR = 0.06


@pytest.fixture(scope="module")
def base(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def checkpoints(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("int8-checkpoints")
    assert cli_main(["quantize", "--model", str(base), "--out", str(root / "w8a8")]) == 0
    w4 = ["quantize", "--model", str(base), "--out", str(root / "w4g32"), "--scheme", "W4A16"]
    assert cli_main([*w4, "--group-size", "32"]) == 0
    return {
        "W8A8": root / "w8a8",
        "W8A16": quantize_folder(base, root / "w8a16", "W8A16"),
        "W8A16-int-quantized": unpacked_w8a16(quantize_folder(base, root / "w8a16i", "W8A16")),
        "W4A16-g32": root / "w4g32",
        "W4A16-g48-zero-points": quantize_folder(
            base, root / "w4g48", "W4A16", group_size=48, symmetric=False
        ),
        "W4A16-channel": quantize_folder(base, root / "w4c", "W4A16", group_size=None),
    }


def unpacked_w8a16(folder):
    """A W8A16 checkpoint rewritten in the `int-quantized` format (int8 weights as
    stored tensors, as W8A8 keeps them), which other writers use."""
    stored = load_file(folder / "model.safetensors")
    tensors = {}
    for name, tensor in stored.items():
        if name.endswith("_packed"):
            stem = name.removesuffix("_packed")
            tensors[stem] = unpack_ints(tensor, int(stored[stem + "_shape"][1]), 8)
        elif not name.endswith("_shape"):
            tensors[name] = tensor
    save_file(tensors, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["format"] = "int-quantized"
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_the_checkpoint_is_compressed_tensors_int8(base, checkpoints):
    config = json.loads((checkpoints["W8A8"] / "config.json").read_text())
    assert read_checkpoint_quantization(config) == "dynamic"
    assert (
        read_checkpoint_quantization(json.loads((checkpoints["W8A16"] / "config.json").read_text()))
        == "weight_only"
    )
    stored = load_file(checkpoints["W8A8"] / "model.safetensors")
    original = load_file(base / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    assert stored[name].dtype == torch.int8 and stored[name + "_scale"].shape == (64, 1)
    error = (stored[name].float() * stored[name + "_scale"] - original[name]).abs()
    assert (error <= stored[name + "_scale"] / 2 + 1e-6).all()
    assert torch.equal(stored["lm_head.weight"], original["lm_head.weight"])
    assert (checkpoints["W8A8"] / "tokenizer.json").is_file()
    w8a16 = json.loads((checkpoints["W8A16"] / "config.json").read_text())
    assert w8a16["quantization_config"]["format"] == "pack-quantized"
    packed = load_file(checkpoints["W8A16"] / "model.safetensors")
    assert packed[name + "_packed"].shape == (64, 32) and name not in packed
    assert torch.equal(unpack_ints(packed[name + "_packed"], 128, 8), stored[name])


def test_the_int4_checkpoint_is_compressed_tensors_pack_quantized(base, checkpoints):
    """int4 values packed eight to an int32 along the inputs, scales per group (ragged
    last group included), zero points packed along the output channels, the shape."""
    schemes = {
        "W4A16-g32": Int4Scheme(32, True),
        "W4A16-g48-zero-points": Int4Scheme(48, False),
        "W4A16-channel": Int4Scheme(None, True),
    }
    original = load_file(base / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"  # [64, 128]
    for scheme, expected in schemes.items():
        config = json.loads((checkpoints[scheme] / "config.json").read_text())
        assert read_checkpoint_quantization(config) == INT4_MODE
        assert read_int4_scheme(config) == expected
        stored = load_file(checkpoints[scheme] / "model.safetensors")
        assert name not in stored and stored[name + "_packed"].shape == (64, 16)
        assert stored[name + "_packed"].dtype == torch.int32
        assert stored[name + "_shape"].tolist() == [64, 128]
        groups = -(-128 // (expected.group_size or 128))
        assert stored[name + "_scale"].shape == (64, groups)
        assert (name + "_zero_point" in stored) == (not expected.symmetric)
        assert torch.equal(stored["lm_head.weight"], original["lm_head.weight"])
    zeros = load_file(checkpoints["W4A16-g48-zero-points"] / "model.safetensors")
    assert zeros[name + "_zero_point"].shape == (8, 3)
    values = unpack_int4(zeros[name + "_packed"], 128)
    assert int(values.min()) >= -8 and int(values.max()) <= 7


@pytest.mark.parametrize(
    "scheme",
    [
        "W8A8",
        "W8A16",
        "W8A16-int-quantized",
        "W4A16-g32",
        "W4A16-g48-zero-points",
        "W4A16-channel",
    ],
)
def test_the_engine_serves_the_stored_quantized_weights(
    checkpoints,
    scheme,
    tmp_path,
    peft_adapter_factory,
    base,
    quantized_checkpoint_oracle,
    hf_prompt_logprobs,
):
    folder = checkpoints[scheme]
    adapter = peft_adapter_factory(base, tmp_path / "qv", target_modules=("q_proj", "v_proj"))
    llm = LLM(str(folder), dtype="float32", max_model_len=128)
    model = llm.engine.runner.model
    qkv = model.layers[0].self_attn.qkv_proj.packed
    stored = load_file(folder / "model.safetensors")
    names = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    if scheme.startswith("W4A16"):
        assert isinstance(qkv, Int4Weight)
        unpacked = [unpack_int4(stored[n + "_packed"], 64) for n in names]
        assert torch.equal(qkv.quantized, torch.cat(unpacked))
        assert model.native_stack is not None
    else:
        assert isinstance(qkv, Int8Weight)
        assert qkv.mode == ("dynamic" if scheme == "W8A8" else "weight_only")
        parts = [
            unpack_ints(stored[n + "_packed"], 64, 8) if n + "_packed" in stored else stored[n]
            for n in names
        ]
        assert torch.equal(qkv.quantized, torch.cat(parts))
    llm.register_adapter("qv", str(adapter))
    rng = random.Random(1)
    prompts = [[rng.randrange(512) for _ in range(rng.choice([6, 30]))] for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=0)
    adapters = [None, "qv", None, "qv"]
    outputs = llm.generate(prompts, params, adapters=adapters)
    oracles = {
        None: quantized_checkpoint_oracle(folder),
        "qv": quantized_checkpoint_oracle(folder, adapter),
    }
    for prompt, output, name in zip(prompts, outputs, adapters, strict=True):
        want = hf_prompt_logprobs(oracles[name], prompt)
        got = torch.tensor([entry.logprob for entry in output.prompt_logprobs[1:]])
        assert (got - want).abs().max().item() < MAX_LOGPROB_ERROR, name


def unserved(config: dict, edit) -> dict:
    changed = copy.deepcopy(config)
    edit(changed["quantization_config"])
    return changed


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda q: q.update(quant_method="gptq"), "quant_method 'gptq'"),
        (lambda q: q.update(format="pack-quantized"), "W8A16 only"),
        (lambda q: q.update(format="float-quantized"), "format 'float-quantized'"),
        (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=4), "num_bits=4"),
        (
            lambda q: q["config_groups"]["group_0"]["weights"].update(
                strategy="group", group_size=128
            ),
            "strategy='group'",
        ),
        (lambda q: q["config_groups"]["group_0"]["weights"].update(symmetric=False), "symmetric"),
        (
            lambda q: q["config_groups"]["group_0"]["input_activations"].update(dynamic=False),
            "input_activations.dynamic=False",
        ),
        (lambda q: q.update(ignore=[]), r"ignore=\[\] is not served"),
        (lambda q: q.update(ignore=["lm_head", "re:.*down_proj"]), "only lm_head stays"),
        (lambda q: q.update(kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme"),
    ],
    ids=[
        "method",
        "packed-int8",
        "format",
        "int4",
        "group",
        "asymmetric",
        "static",
        "lm_head",
        "more",
        "kv",
    ],
)
def test_what_the_engine_cannot_serve_exactly_is_refused(checkpoints, edit, message):
    config = json.loads((checkpoints["W8A8"] / "config.json").read_text())
    with pytest.raises(ValueError, match=message):
        read_checkpoint_quantization(unserved(config, edit))


def int4_weights(edit):
    return lambda q: edit(q["config_groups"]["group_0"]["weights"])


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (int4_weights(lambda w: w.update(actorder="group")), "actorder='group'"),
        (int4_weights(lambda w: w.update(strategy="tensor")), "strategy='tensor'"),
        (int4_weights(lambda w: w.update(group_size=None)), "group_size=None"),
        (int4_weights(lambda w: w.update(type="float")), "type='float'"),
        (
            lambda q: q["config_groups"]["group_0"].update(
                input_activations={"num_bits": 8, "type": "int", "strategy": "token"}
            ),
            "W4A16 only",
        ),
    ],
    ids=["actorder-group", "tensor", "no-group-size", "float", "activations"],
)
def test_what_an_int4_checkpoint_cannot_be_served_with_is_refused(checkpoints, edit, message):
    config = json.loads((checkpoints["W4A16-g32"] / "config.json").read_text())
    with pytest.raises(ValueError, match=message):
        read_checkpoint_quantization(unserved(config, edit))


def test_an_int4_checkpoint_runs_as_stored(checkpoints):
    with pytest.raises(ValueError, match="int4 checkpoint runs as stored"):
        LLM(str(checkpoints["W4A16-g32"]), dtype="float32", quantization="int8")


def test_an_int4_checkpoint_takes_an_int8_lm_head(
    checkpoints,
    tmp_path,
    peft_adapter_factory,
    base,
    quantized_checkpoint_oracle,
    hf_prompt_logprobs,
):
    """`quantize_lm_head` over an int4 checkpoint: the LM head runs W8A8 (its tied
    embedding table stays as it was), base and adapter answers within the tolerance."""
    folder = checkpoints["W4A16-g48-zero-points"]
    adapter = peft_adapter_factory(base, tmp_path / "qv", target_modules=("q_proj", "v_proj"))
    llm = LLM(str(folder), dtype="float32", max_model_len=128, quantize_lm_head=True)
    model = llm.engine.runner.model
    assert isinstance(model.packed_lm_head, Int8Weight) and model.packed_lm_head.mode == "dynamic"
    llm.register_adapter("qv", str(adapter))
    rng = random.Random(2)
    prompts = [[rng.randrange(512) for _ in range(20)] for _ in range(2)]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=0)
    outputs = llm.generate(prompts, params, adapters=[None, "qv"])
    oracles = [quantized_checkpoint_oracle(folder), quantized_checkpoint_oracle(folder, adapter)]
    for prompt, output, oracle in zip(prompts, outputs, oracles, strict=True):
        want = hf_prompt_logprobs(oracle, prompt)
        got = torch.tensor([entry.logprob for entry in output.prompt_logprobs[1:]])
        assert (got - want).abs().max().item() < MAX_LOGPROB_ERROR
