"""Int8 projections quantized on load (`quantization`, kernels/int8_matmul.py) against
the oracle: transformers with each decoder projection replaced by its dequantized int8
weight, and PEFT's adapter on that base. Within a stated tolerance, as quantized
activations (W8A8) and bf16 activations (weight-only) round: every prompt token's
logprob, teacher-forced, within MAX_LOGPROB_ERROR nats, base and adapter requests in one
batch, fp32 and bf16 engines."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.kernels.int8_matmul import (
    Int8Weight,
    dequantize,
    quantize_per_channel,
    smoothing_gain,
)
from loraplex.platform.layers.linear import MergedLinear
from loraplex.platform.llm import LLM
from loraplex.platform.request import SamplingParams

MAX_LOGPROB_ERROR = 0.06
"""Nats; measured up to 0.048 on the tiny Llama (bf16 engine, W8A8)."""
MAX_LOGPROB_ERROR_UNEVEN = 0.08
"""Nats, on the tiny Llama with uneven norm weights (`with_uneven_norms`), whose larger
activations round further: measured up to 0.062 for the bf16 W8A8 engine against the
smoothed oracle (0.073 with smoothing off in both)."""


def with_uneven_norms(base: Path, folder: Path) -> Path:
    """A copy of `base` whose RMSNorm weights vary per channel (0.5 to 1.5, a few at 3),
    as trained models' do, so W8A8's smoothing by them changes the quantized weights."""
    shutil.copytree(base, folder)
    weights = load_file(folder / "model.safetensors")
    generator = torch.Generator().manual_seed(11)
    for name, tensor in weights.items():
        if name.endswith("norm.weight"):
            gain = torch.empty(tensor.shape).uniform_(0.5, 1.5, generator=generator)
            gain[torch.randperm(tensor.numel(), generator=generator)[:3]] = 3.0
            weights[name] = gain
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def setup(tiny_model_factory, tmp_path_factory, peft_adapter_factory):
    base = tiny_model_factory("llama")
    adapter = peft_adapter_factory(
        base,
        tmp_path_factory.mktemp("quantized") / "qvd",
        target_modules=("q_proj", "v_proj", "down_proj"),
        seed=3,
    )
    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(rng.choice([5, 20, 40]))] for _ in range(8)]
    return base, adapter, prompts


SMOOTHED_BY = {
    "q_proj": "input_layernorm",
    "k_proj": "input_layernorm",
    "v_proj": "input_layernorm",
    "gate_proj": "post_attention_layernorm",
    "up_proj": "post_attention_layernorm",
}
"""Projections whose W8A8 form is smoothed by the RMSNorm before them."""


def dequantized_oracle(base, adapter, smoothed: bool):
    """HF's model with every decoder projection's weight replaced by its dequantized
    int8 form (PEFT's unmerged adapter on top when given). `smoothed` (W8A8): a
    projection after an RMSNorm is quantized times the norm's weight, per input channel,
    and divided by it again (kernels/int8_matmul.py, input gain)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    parameters = dict(model.named_parameters())
    with torch.no_grad():
        for name, weight in parameters.items():
            if ".layers." not in name or not name.endswith("proj.weight"):
                continue
            prefix, kind = name.removesuffix(".weight").rsplit(".", 2)[0], name.split(".")[-2]
            if smoothed and kind in SMOOTHED_BY:
                gain = smoothing_gain(parameters[f"{prefix}.{SMOOTHED_BY[kind]}.weight"])
                weight.copy_(dequantize(*quantize_per_channel(weight * gain)) / gain)
            else:
                weight.copy_(dequantize(*quantize_per_channel(weight)))
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    return model.eval()


def assert_within_tolerance(llm, prompts, oracle, tolerance=MAX_LOGPROB_ERROR) -> None:
    """Base and adapter requests in one batch: every prompt token's logprob within
    `tolerance` of the oracle's."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    adapters = [None, "qvd"] * (len(prompts) // 2)
    outputs = llm.generate(prompts, params, adapters=adapters)
    for index, (output, name) in enumerate(zip(outputs, adapters, strict=True)):
        got = torch.tensor([entry.logprob for entry in output.prompt_logprobs[1:]])
        want = oracle["adapter" if name else "base"][index]
        error = (got - want).abs().max().item()
        assert error < tolerance, (index, name, error)


@pytest.fixture(scope="module")
def oracles(setup, hf_prompt_logprobs):
    """Per quantization: the dequantized oracle's prompt logprobs, base and adapter."""
    base, adapter, prompts = setup
    return {
        quantization: {
            name: [
                hf_prompt_logprobs(dequantized_oracle(base, folder, smoothed), p) for p in prompts
            ]
            for name, folder in (("base", None), ("adapter", adapter))
        }
        for quantization, smoothed in (("int8", True), ("int8_weight_only", False))
    }


@pytest.mark.parametrize("quantization", ["int8", "int8_weight_only"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_engine_matches_the_dequantized_oracle(setup, oracles, quantization, dtype):
    base, adapter, prompts = setup
    llm = LLM(str(base), dtype=dtype, quantization=quantization, max_model_len=128)
    llm.register_adapter("qvd", str(adapter))
    assert_within_tolerance(llm, prompts, oracles[quantization])
    projections = [m for m in llm.engine.runner.model.modules() if isinstance(m, MergedLinear)]
    assert projections and all(isinstance(m.packed, Int8Weight) for m in projections)
    assert all(m.weight.numel() == 0 for m in projections), "the float weights were kept"


def test_a_quantized_lm_head_stays_within_the_tolerance(setup, oracles):
    """`quantize_lm_head`: the LM head is int8 too (its logits' rows per output
    channel), the embedding table it was tied to or not stays in the dtype."""
    base, adapter, prompts = setup
    llm = LLM(
        str(base), dtype="bfloat16", quantization="int8", quantize_lm_head=True, max_model_len=128
    )
    model = llm.engine.runner.model
    assert isinstance(model.packed_lm_head, Int8Weight) and model.embed_tokens.numel() > 0
    llm.register_adapter("qvd", str(adapter))
    assert_within_tolerance(llm, prompts, oracles["int8"])
    with pytest.raises(ValueError, match="quantize_lm_head needs a quantization"):
        LLM(str(base), quantize_lm_head=True)


def test_the_oracle_tells_the_adapter_from_the_base(oracles):
    """Guards the tolerance: the adapter moves some prompt logprob by far more."""
    pairs = zip(oracles["int8"]["adapter"], oracles["int8"]["base"], strict=True)
    gaps = [(a - b).abs().max().item() for a, b in pairs]
    assert max(gaps) > 5 * MAX_LOGPROB_ERROR


@pytest.fixture(scope="module")
def uneven(setup, tmp_path_factory, hf_prompt_logprobs):
    """The tiny Llama with uneven norm weights, the same adapter, and its smoothed W8A8
    oracle's prompt logprobs."""
    base, adapter, prompts = setup
    uneven_base = with_uneven_norms(base, tmp_path_factory.mktemp("uneven-norms") / "model")
    oracle = {
        name: [
            hf_prompt_logprobs(dequantized_oracle(uneven_base, folder, True), p) for p in prompts
        ]
        for name, folder in (("base", None), ("adapter", adapter))
    }
    return uneven_base, adapter, prompts, oracle


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_w8a8_smoothing_by_uneven_norms_matches_its_oracle(uneven, dtype):
    """Where the norms' weights differ per channel the smoothing changes the quantized
    weights; the engine still matches the oracle that quantizes them the same way."""
    base, adapter, prompts, oracle = uneven
    llm = LLM(str(base), dtype=dtype, quantization="int8", max_model_len=128)
    llm.register_adapter("qvd", str(adapter))
    assert_within_tolerance(llm, prompts, oracle, MAX_LOGPROB_ERROR_UNEVEN)


def test_w8a8_projections_after_a_norm_are_smoothed_by_it(uneven):
    """q/k/v and gate/up hold 1 / their norm's weight as input scales (o and down none),
    and the LM head with quantize_lm_head the final norm's; weight-only holds none."""
    base = uneven[0]
    model = LLM(
        str(base), quantization="int8", quantize_lm_head=True, max_model_len=128
    ).engine.runner.model
    for layer in model.layers:
        qkv, gate_up = layer.self_attn.qkv_proj.packed, layer.mlp.gate_up_proj.packed
        gain = smoothing_gain(layer.input_layernorm.weight)
        torch.testing.assert_close(qkv.input_scales, 1.0 / gain)
        gain = smoothing_gain(layer.post_attention_layernorm.weight)
        torch.testing.assert_close(gate_up.input_scales, 1.0 / gain)
        assert layer.self_attn.o_proj.packed.input_scales is None
        assert layer.mlp.down_proj.packed.input_scales is None
    torch.testing.assert_close(
        model.packed_lm_head.input_scales, 1.0 / smoothing_gain(model.norm.weight)
    )
    weight_only = LLM(str(base), quantization="int8_weight_only", max_model_len=128)
    qkv = weight_only.engine.runner.model.layers[0].self_attn.qkv_proj.packed
    assert qkv.input_scales is None


def test_an_unknown_quantization_is_refused(setup):
    base, _, _ = setup
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(str(base), quantization="int4")
