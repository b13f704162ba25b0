"""Int8 projections quantized on load (`quantization`, kernels/int8_matmul.py) against
the oracle: transformers with each decoder projection replaced by its dequantized int8
weight, and PEFT's adapter on that base. Within a stated tolerance, as quantized
activations (W8A8) and bf16 activations (weight-only) round: every prompt token's
logprob, teacher-forced, within MAX_LOGPROB_ERROR nats, base and adapter requests in one
batch, fp32 and bf16 engines."""

from __future__ import annotations

import random

import pytest
import torch

from loraplex.kernels.int8_matmul import Int8Weight, dequantize, quantize_per_channel
from loraplex.platform.layers.linear import MergedLinear
from loraplex.platform.llm import LLM
from loraplex.platform.request import SamplingParams

MAX_LOGPROB_ERROR = 0.06
"""Nats; measured up to 0.048 on the tiny Llama (bf16 engine, W8A8)."""


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


def dequantized_oracle(base, adapter):
    """HF's model with every decoder projection's weight replaced by its dequantized
    int8 form (PEFT's unmerged adapter on top when given)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if ".layers." in name and name.endswith("proj.weight"):
                weight.copy_(dequantize(*quantize_per_channel(weight)))
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    return model.eval()


def assert_within_tolerance(llm, prompts, oracle) -> None:
    """Base and adapter requests in one batch: every prompt token's logprob within
    MAX_LOGPROB_ERROR of the oracle's."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    adapters = [None, "qvd"] * (len(prompts) // 2)
    outputs = llm.generate(prompts, params, adapters=adapters)
    for index, (output, name) in enumerate(zip(outputs, adapters, strict=True)):
        got = torch.tensor([entry.logprob for entry in output.prompt_logprobs[1:]])
        want = oracle["adapter" if name else "base"][index]
        error = (got - want).abs().max().item()
        assert error < MAX_LOGPROB_ERROR, (index, name, error)


@pytest.fixture(scope="module")
def oracle(setup, hf_prompt_logprobs):
    base, adapter, prompts = setup
    return {
        name: [hf_prompt_logprobs(dequantized_oracle(base, folder), p) for p in prompts]
        for name, folder in (("base", None), ("adapter", adapter))
    }


@pytest.mark.parametrize("quantization", ["int8", "int8_weight_only"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_engine_matches_the_dequantized_oracle(setup, oracle, quantization, dtype):
    base, adapter, prompts = setup
    llm = LLM(str(base), dtype=dtype, quantization=quantization, max_model_len=128)
    llm.register_adapter("qvd", str(adapter))
    assert_within_tolerance(llm, prompts, oracle)
    projections = [m for m in llm.engine.runner.model.modules() if isinstance(m, MergedLinear)]
    assert projections and all(isinstance(m.packed, Int8Weight) for m in projections)
    assert all(m.weight.numel() == 0 for m in projections), "the float weights were kept"


def test_a_quantized_lm_head_stays_within_the_tolerance(setup, oracle):
    """`quantize_lm_head`: the LM head is int8 too (its logits' rows per output
    channel), the embedding table it was tied to or not stays in the dtype."""
    base, adapter, prompts = setup
    llm = LLM(
        str(base), dtype="bfloat16", quantization="int8", quantize_lm_head=True, max_model_len=128
    )
    model = llm.engine.runner.model
    assert isinstance(model.packed_lm_head, Int8Weight) and model.embed_tokens.numel() > 0
    llm.register_adapter("qvd", str(adapter))
    assert_within_tolerance(llm, prompts, oracle)
    with pytest.raises(ValueError, match="quantize_lm_head needs a quantization"):
        LLM(str(base), quantize_lm_head=True)


def test_the_oracle_tells_the_adapter_from_the_base(oracle):
    """Guards the tolerance: the adapter moves some prompt logprob by far more."""
    pairs = zip(oracle["adapter"], oracle["base"], strict=True)
    gaps = [(a - b).abs().max().item() for a, b in pairs]
    assert max(gaps) > 5 * MAX_LOGPROB_ERROR


def test_an_unknown_quantization_is_refused(setup):
    base, _, _ = setup
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(str(base), quantization="int4")
