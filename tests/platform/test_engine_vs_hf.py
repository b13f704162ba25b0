"""Greedy fp32 outputs equal HF transformers `generate`, token for token, in every mode.

Modes: defaults; small token budget (chunked prefill mixed with decodes); prefix
caching with shared prefixes; a KV budget small enough to force preemption;
max_num_seqs=1. The batch has 16+ prompts of mixed lengths, some sharing prefixes.
"""

from __future__ import annotations

import random

import pytest
import torch

from loraplex.platform.llm import LLM
from loraplex.platform.request import SamplingParams

MAX_NEW = 12

MODES = {
    "defaults": dict(),
    "chunked": dict(max_num_batched_tokens=24, enable_chunked_prefill=True),
    "no_prefix_cache": dict(enable_prefix_caching=False),
    "preempt": dict(num_blocks_override=16, block_size=8, max_model_len=128),
    "one_seq": dict(max_num_seqs=1),
}


def mixed_prompts(vocab: int, count: int = 18, seed: int = 0) -> list[list[int]]:
    """Mixed lengths 1..60; a third share a 33-token prefix, two are identical."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(33)]
    prompts = []
    for i in range(count):
        length = rng.choice([1, 2, 5, 16, 17, 31, 48, 60])
        tail = [rng.randrange(vocab) for _ in range(length)]
        prompts.append(shared + tail if i % 3 == 0 else tail)
    prompts.append(list(prompts[0]))
    return prompts


def hf_greedy(folder, prompts: list[list[int]], max_new: int, stop_at_eos: bool) -> list[list[int]]:
    """One prompt at a time (no padding), so the oracle has no padding effects."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            kwargs = {} if stop_at_eos else {"eos_token_id": None}
            generated = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new,
                do_sample=False,
                pad_token_id=0,
                **kwargs,
            )
            new = generated[0, len(prompt) :].tolist()
            eos = model.generation_config.eos_token_id
            eos_ids = (
                set(eos if isinstance(eos, list) else [eos])
                if stop_at_eos and eos is not None
                else set()
            )
            cut = next((i + 1 for i, t in enumerate(new) if t in eos_ids), len(new))
            outputs.append(new[:cut])
    return outputs


def run_engine(folder, prompts, mode_options, max_new, ignore_eos=True, max_model_len=256):
    options = {"max_model_len": max_model_len, "dtype": "float32"}
    options.update(mode_options)
    llm = LLM(str(folder), **options)
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=ignore_eos)
    outputs = llm.generate(prompts, params)
    llm.engine.kv_cache.check_invariants()
    assert llm.engine.kv_cache.pool.num_free == llm.engine.kv_cache.pool.num_blocks
    return [o.token_ids for o in outputs], llm


@pytest.fixture(scope="module", params=["llama", "qwen2", "llama3_tied"])
def tiny_reference(request, tiny_model_factory):
    if request.param == "llama3_tied":
        folder = tiny_model_factory("llama3", tie_word_embeddings=True)
    elif request.param == "qwen2":
        folder = tiny_model_factory("qwen2", num_key_value_heads=1)
    else:
        folder = tiny_model_factory("llama")
    prompts = mixed_prompts(vocab=512)
    return folder, prompts, hf_greedy(folder, prompts, MAX_NEW, stop_at_eos=False)


@pytest.mark.parametrize("mode", list(MODES))
def test_tiny_models_match_hf_in_every_mode(tiny_reference, mode):
    folder, prompts, expected = tiny_reference
    got, llm = run_engine(folder, prompts, MODES[mode], MAX_NEW)
    if mode == "preempt":
        assert llm.engine.scheduler.num_preemptions > 0, "the KV budget did not force preemption"
    if mode == "defaults":
        assert llm.engine.kv_cache.prefix_hits > 0, "shared prefixes did not hit the cache"
    for index, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
        assert ours == theirs, f"prompt {index} (len {len(prompts[index])}) differs in mode {mode}"


DEFAULT_MODES = {
    "defaults": dict(),
    "chunked": dict(max_num_batched_tokens=32),
    "preempt": dict(num_blocks_override=12, max_model_len=160),
    "one_seq": dict(max_num_seqs=1),
}


@pytest.fixture(scope="module")
def default_reference():
    from loraplex.platform.model_files import resolve_model_folder
    from loraplex.platform.tokenizer import load_tokenizer

    folder = resolve_model_folder("smollm2-135m-instruct")
    tokenizer = load_tokenizer(folder)
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "List three primary colors.",
        "Explain gravity to a child in one sentence.",
        "Translate 'good morning' into Spanish.",
        "What is 12 times 12?",
        "Name a famous painting by Leonardo da Vinci.",
        "Why is the sky blue?",
    ]
    system = "You are a concise assistant. Answer briefly and precisely, in plain English."
    prompts = []
    for i, question in enumerate(questions * 2):
        messages = [{"role": "user", "content": question if i < 8 else question + " Be brief."}]
        if i % 2 == 0:
            messages.insert(0, {"role": "system", "content": system})
        encoded = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        prompts.append(list(encoded["input_ids"]))
    prompts.append(list(prompts[0]))
    return folder, prompts, hf_greedy(folder, prompts, 16, stop_at_eos=True)


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(DEFAULT_MODES))
def test_default_model_matches_hf(default_reference, mode):
    folder, prompts, expected = default_reference
    got, llm = run_engine(
        folder, prompts, DEFAULT_MODES[mode], 16, ignore_eos=False, max_model_len=512
    )
    if mode == "preempt":
        assert llm.engine.scheduler.num_preemptions > 0
    for index, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
        assert ours == theirs, f"prompt {index} differs in mode {mode}"


def test_logit_bias_and_min_tokens_match_hf(tiny_model_factory):
    """EOS pushed to the top by a +100 logit bias: HF's `sequence_bias` and
    `min_new_tokens` and the engine's `logit_bias` and `min_tokens` give the same tokens:
    `min_tokens` non-EOS tokens, then EOS. A -100 bias on a token the model would pick
    keeps it out of both."""
    from transformers import AutoModelForCausalLM

    eos = 7
    folder = tiny_model_factory("llama", eos_token_id=eos)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = mixed_prompts(model.config.vocab_size, count=4, seed=5)
    llm = LLM(str(folder), max_model_len=256, dtype="float32")
    for min_tokens in (0, 3, 7):
        plain = llm.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        )
        banned = plain[0].token_ids[0]
        bias = {eos: 100.0, banned: -100.0}
        params = SamplingParams(
            temperature=0.0, max_tokens=MAX_NEW, min_tokens=min_tokens, logit_bias=bias
        )
        ours = [o.token_ids for o in llm.generate(prompts, params)]
        with torch.inference_mode():
            for prompt, got in zip(prompts, ours, strict=True):
                ids = torch.tensor([prompt])
                generated = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=MAX_NEW,
                    min_new_tokens=min_tokens,
                    sequence_bias={(t,): b for t, b in bias.items()},
                    do_sample=False,
                    pad_token_id=0,
                    eos_token_id=eos,
                )
                assert got == generated[0, len(prompt) :].tolist()
                assert len(got) == min_tokens + 1 and got[-1] == eos and banned not in got
