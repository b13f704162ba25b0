"""`loraplex quantize` writes an int8 compressed-tensors checkpoint that the engine
loads as stored (platform/models/compressed_tensors.py): W8A8 and W8A16, the stored
int8 values are the projections' own, and the answers of the base model and a PEFT
adapter on it stay within the tolerance of transformers + PEFT on the dequantized
weights. Configs the engine cannot serve exactly are refused by name."""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch
from safetensors.torch import load_file

from loraplex.kernels.int8_matmul import Int8Weight
from loraplex.platform.llm import LLM
from loraplex.platform.models.compressed_tensors import read_checkpoint_quantization
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
    return {
        "W8A8": root / "w8a8",
        "W8A16": quantize_folder(base, root / "w8a16", "W8A16"),
    }


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


@pytest.mark.parametrize("scheme", ["W8A8", "W8A16"])
def test_the_engine_serves_the_stored_int8_weights(
    checkpoints,
    scheme,
    tmp_path,
    peft_adapter_factory,
    base,
    int8_checkpoint_oracle,
    hf_prompt_logprobs,
):
    folder = checkpoints[scheme]
    adapter = peft_adapter_factory(base, tmp_path / "qv", target_modules=("q_proj", "v_proj"))
    llm = LLM(str(folder), dtype="float32", max_model_len=128)
    model = llm.engine.runner.model
    qkv = model.layers[0].self_attn.qkv_proj.packed
    assert isinstance(qkv, Int8Weight)
    assert qkv.mode == ("dynamic" if scheme == "W8A8" else "weight_only")
    stored = load_file(folder / "model.safetensors")
    names = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    assert torch.equal(qkv.quantized, torch.cat([stored[n] for n in names]))
    llm.register_adapter("qv", str(adapter))
    rng = random.Random(1)
    prompts = [[rng.randrange(512) for _ in range(rng.choice([6, 30]))] for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=0)
    adapters = [None, "qv", None, "qv"]
    outputs = llm.generate(prompts, params, adapters=adapters)
    oracles = {None: int8_checkpoint_oracle(folder), "qv": int8_checkpoint_oracle(folder, adapter)}
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
        (lambda q: q.update(format="pack-quantized"), "format 'pack-quantized'"),
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
    ids=["method", "format", "int4", "group", "asymmetric", "static", "lm_head", "more", "kv"],
)
def test_what_the_engine_cannot_serve_exactly_is_refused(checkpoints, edit, message):
    config = json.loads((checkpoints["W8A8"] / "config.json").read_text())
    with pytest.raises(ValueError, match=message):
        read_checkpoint_quantization(unserved(config, edit))
