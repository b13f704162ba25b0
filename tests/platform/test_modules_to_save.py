"""Adapters saved with PEFT's `modules_to_save` (their own `lm_head`, `embed_tokens`, or
both) equal PEFT on HF transformers, greedy fp32, token for token: in batches mixed
with the base model and a plain LoRA adapter, with the prefix cache, forced preemption
and fewer slots than adapters; prompt logprobs through an adapter's own head; a base
whose embeddings are tied; a resized vocabulary within the engine's cap."""

from __future__ import annotations

import random

import pytest
import torch

from loraplex.platform.guided import GuidedSpec
from loraplex.platform.llm import LLM
from loraplex.platform.request import SamplingParams

MAX_NEW = 8
ADAPTERS = {
    "head": dict(rank=4, target_modules=("q_proj",), modules_to_save=("lm_head",), seed=31),
    "embed": dict(rank=4, target_modules=("v_proj",), modules_to_save=("embed_tokens",), seed=32),
    "both": dict(
        rank=8,
        target_modules=("q_proj", "down_proj"),
        modules_to_save=("lm_head", "embed_tokens"),
        seed=33,
    ),
    "plain": dict(rank=4, target_modules=("q_proj", "v_proj"), seed=34),
}
MODES = {
    "prefix_cache": dict(),
    "preempt": dict(num_blocks_override=20, block_size=8),
    "two_slots": dict(max_loras=2, max_num_batched_tokens=40),
}


@pytest.fixture(scope="module")
def setup(tiny_model_factory, tmp_path_factory, peft_adapter_factory):
    base = tiny_model_factory("llama")
    root = tmp_path_factory.mktemp("saved-modules")
    folders = {
        name: peft_adapter_factory(base, root / name, **options)
        for name, options in ADAPTERS.items()
    }
    return base, folders


def requests_for(names: list[str], vocab: int = 512, seed: int = 0):
    """(prompt, adapter) pairs over every adapter and the base, with a shared prefix."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(17)]
    cycle = [None, *names]
    requests = []
    for i in range(12):
        tail = [rng.randrange(vocab) for _ in range(rng.choice([1, 5, 12, 23]))]
        requests.append((shared + tail if i % 2 else tail, cycle[i % len(cycle)]))
    return requests


def oracle_outputs(peft_oracle, hf_greedy, base, folders, requests) -> list[list[int]]:
    result: list[list[int] | None] = [None] * len(requests)
    for adapter in {a for _, a in requests}:
        indices = [i for i, (_, a) in enumerate(requests) if a == adapter]
        model = peft_oracle(base, folders[adapter] if adapter else None)
        outputs = hf_greedy(model, [requests[i][0] for i in indices], MAX_NEW)
        for i, out in zip(indices, outputs, strict=True):
            result[i] = out
    return result


@pytest.fixture(scope="module")
def expected(setup, peft_oracle, hf_greedy):
    base, folders = setup
    requests = requests_for(list(folders))
    return requests, oracle_outputs(peft_oracle, hf_greedy, base, folders, requests)


@pytest.mark.parametrize("mode", list(MODES))
def test_saved_modules_in_mixed_batches_match_peft(setup, expected, mode):
    base, folders = setup
    requests, want = expected
    llm = LLM(str(base), dtype="float32", max_model_len=128, **MODES[mode])
    for name, folder in folders.items():
        llm.register_adapter(name, str(folder))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = llm.generate([p for p, _ in requests], params, adapters=[a for _, a in requests])
    got = [o.token_ids for o in outputs]
    mismatches = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
    assert not mismatches, f"requests {mismatches} differ from PEFT ({mode})"
    engine = llm.engine
    assert engine.kv_cache.pool.num_free == engine.kv_cache.pool.num_blocks
    if mode == "preempt":
        assert engine.scheduler.num_preemptions > 0
    if mode == "two_slots":
        assert engine.runner.lora_slots.stats.evictions > 0


def test_saved_modules_change_outputs(setup, expected, peft_oracle, hf_greedy):
    """Guards the oracle: each adapter's saved module changes PEFT's greedy outputs from
    those of its LoRA pairs alone (the saved copy switched off)."""
    requests, want = expected
    base, folders = setup
    for name, module in (("head", "lm_head"), ("embed", "model.embed_tokens")):
        indices = [i for i, (_, adapter) in enumerate(requests) if adapter == name]
        model = peft_oracle(base, folders[name])
        model.base_model.model.get_submodule(module).enable_adapters(False)
        without = hf_greedy(model, [requests[i][0] for i in indices], MAX_NEW)
        assert without != [want[i] for i in indices], name


@pytest.mark.parametrize("saved", [("lm_head",), ("embed_tokens",), ("lm_head", "embed_tokens")])
def test_saved_modules_on_a_base_with_tied_embeddings_match_peft(
    saved, tiny_model_factory, tmp_path, peft_adapter_factory, peft_oracle, hf_greedy
):
    """On a base whose LM head is its embedding table (the default model's case), the
    saved copy replaces only the module it saved, as in PEFT."""
    base = tiny_model_factory("llama", tie_word_embeddings=True)
    folder = peft_adapter_factory(
        base, tmp_path / "tied", target_modules=("v_proj",), modules_to_save=saved, seed=36
    )
    requests = [(prompt, "tied") for prompt, _ in requests_for([], seed=3)[:4]]
    requests += [(requests[0][0], None)]
    want = oracle_outputs(peft_oracle, hf_greedy, base, {"tied": folder}, requests)
    llm = LLM(str(base), dtype="float32", max_model_len=128)
    llm.register_adapter("tied", str(folder))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = llm.generate([p for p, _ in requests], params, adapters=[a for _, a in requests])
    assert [o.token_ids for o in outputs] == want
    assert want[0] != want[-1], "the adapter changes the output"


RESIZED_VOCAB = 520


@pytest.fixture(scope="module")
def resized(tiny_model_factory, tmp_path_factory, peft_adapter_factory):
    """An adapter that resized the vocabulary to 520 tokens (with its tokenizer), its
    new LM head rows scaled up so that greedy decoding picks new tokens."""
    from safetensors.torch import load_file, save_file

    base = tiny_model_factory("llama")
    folder = peft_adapter_factory(
        base,
        tmp_path_factory.mktemp("resized") / "resized",
        target_modules=("q_proj",),
        modules_to_save=("lm_head", "embed_tokens"),
        vocab_size=RESIZED_VOCAB,
        seed=37,
    )
    file = folder / "adapter_model.safetensors"
    tensors = load_file(file)
    for name in tensors:
        if "lm_head" in name and "original_module" not in name:
            tensors[name][512:] *= 4.0
    save_file(tensors, file, metadata={"format": "pt"})
    return base, folder


def test_a_resized_vocabulary_matches_peft_beside_the_base(resized, peft_oracle, hf_greedy):
    """Prompts holding new tokens, completions that pick them and feed them back: equal
    to PEFT on the resized base; the base model's requests in the same batch are
    unchanged, and the engine refuses the new ids for them."""
    base, folder = resized
    rng = random.Random(7)
    prompts = [
        [rng.randrange(RESIZED_VOCAB) for _ in range(rng.choice([3, 9, 20]))] + [515]
        for _ in range(5)
    ]
    base_prompts = [[t % 512 for t in p] for p in prompts[:2]]
    requests = [(p, "resized") for p in prompts] + [(p, None) for p in base_prompts]
    want = oracle_outputs(peft_oracle, hf_greedy, base, {"resized": folder}, requests)
    assert any(t >= 512 for out in want[:5] for t in out), "no new token picked"
    llm = LLM(str(base), dtype="float32", max_model_len=128, max_adapter_vocab_size=RESIZED_VOCAB)
    llm.register_adapter("resized", str(folder))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = llm.generate([p for p, _ in requests], params, adapters=[a for _, a in requests])
    assert [o.token_ids for o in outputs] == want
    with pytest.raises(ValueError, match=r"out of range \[0, 512\)"):
        llm.generate([[3, 515]], params)


def test_a_resized_vocabulary_reads_and_writes_text_in_its_tokenizer(
    resized, peft_oracle, hf_greedy
):
    base, folder = resized
    llm = LLM(str(base), dtype="float32", max_model_len=128, max_adapter_vocab_size=RESIZED_VOCAB)
    llm.register_adapter("resized", str(folder))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    [output] = llm.generate(["w3 w515 w7 w519"], params, adapters=["resized"])
    assert output.prompt_token_ids == [3, 515, 7, 519]
    want = oracle_outputs(
        peft_oracle, hf_greedy, base, {"resized": folder}, [([3, 515, 7, 519], "resized")]
    )
    assert output.token_ids == want[0]
    assert output.text.split() == [f"w{t}" for t in want[0]]
    assert any(t >= 512 for t in want[0]), "the text holds a new token"
    refused = SamplingParams(temperature=0.0, max_tokens=4, guided=GuidedSpec("regex", "w1"))
    with pytest.raises(ValueError, match="resizes the vocabulary"):
        llm.generate(["w3"], refused, adapters=["resized"])


def test_prompt_logprobs_come_from_the_adapters_own_head(setup, peft_oracle, hf_prompt_logprobs):
    """Prompt logprobs (the scored rows of a prefill) of an adapter that saved its LM
    head equal PEFT's log-softmax over that head, within fp32 rounding; the base's in
    the same batch equal the base's."""
    base, folders = setup
    prompt = requests_for([], seed=9)[1][0]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=2)
    llm = LLM(str(base), dtype="float32", max_model_len=128)
    llm.register_adapter("head", str(folders["head"]))
    outputs = llm.generate([prompt, prompt], params, adapters=["head", None])
    for output, adapter in zip(outputs, ("head", None), strict=True):
        model = peft_oracle(base, folders[adapter] if adapter else None)
        want = hf_prompt_logprobs(model, prompt)
        got = torch.tensor([lp.logprob for lp in output.prompt_logprobs[1:]])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    pairs = zip(outputs[0].prompt_logprobs[1:], outputs[1].prompt_logprobs[1:], strict=True)
    assert all(a.logprob != b.logprob for a, b in pairs)
