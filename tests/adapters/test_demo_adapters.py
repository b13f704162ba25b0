"""The shipped demo adapters on the default model: real, valid, visibly different, and
served by the engine exactly as PEFT runs them (greedy, fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraplex.platform import LLM, SamplingParams

DEMO = Path(__file__).resolve().parents[2] / "adapters" / "demo"
QUESTION = [{"role": "user", "content": "How many legs does a cat have?"}]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def answers():
    llm = LLM("smollm2-135m-instruct", dtype="float32", max_model_len=512, max_lora_rank=16)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    adapters = [None, str(DEMO / "french"), str(DEMO / "pirate")]
    outputs = llm.chat([QUESTION] * 3, params, adapters=adapters)
    return llm, dict(zip(["base", "french", "pirate"], outputs, strict=True))


@pytest.mark.slow
def test_demo_adapters_answer_in_their_style(answers):
    _, out = answers
    assert "four legs" in out["base"].text
    assert "pattes" in out["french"].text
    assert out["pirate"].text.startswith("Arr")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["french", "pirate"])
def test_demo_adapters_match_peft(answers, name):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from loraplex.platform.model_files import resolve_model_folder

    llm, out = answers
    prompt = llm.chat_prompt_ids(QUESTION)
    base = AutoModelForCausalLM.from_pretrained(
        resolve_model_folder("smollm2-135m-instruct"), dtype=torch.float32
    )
    model = PeftModel.from_pretrained(base, DEMO / name).eval()
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        generated = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
        )
    expected = generated[0, len(prompt) :].tolist()
    eos = set(llm.engine.eos_token_ids)
    cut = next((i + 1 for i, t in enumerate(expected) if t in eos), len(expected))
    assert out[name].token_ids == expected[:cut]
