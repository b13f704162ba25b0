"""Prompt logprobs equal HF transformers' (and PEFT's, with an adapter): the log-softmax
of the logits at each position, scoring the next prompt token, its rank and the top k;
in one chunk or many, after a preemption, beside prefix-cache hits of other requests,
and with n > 1. Each prompt token is scored once."""

from __future__ import annotations

import random

import pytest
import torch

from loraplex.platform.llm import LLM
from loraplex.platform.prompt_logprobs import LOGITS_ROWS_PER_SLICE, positions_to_score
from loraplex.platform.request import Request, SamplingParams

K = 3
WANTS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=K)


def reference(base, prompt: list[int], adapter=None) -> torch.Tensor:
    """HF's (or PEFT's) log-softmax over the vocabulary at every prompt position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    with torch.inference_mode():
        logits = model.eval()(torch.tensor([prompt])).logits[0]
    return logits.float().log_softmax(dim=-1)


def assert_matches(got, prompt: list[int], want: torch.Tensor, k: int = K) -> None:
    assert got is not None and len(got) == len(prompt)
    assert got[0] is None
    for position, entry in enumerate(got[1:]):
        row = want[position]
        token = prompt[position + 1]
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(row[token].item(), abs=1e-4)
        value = row[token].item()
        assert int((row > value + 1e-4).sum()) + 1 <= entry.rank
        assert entry.rank <= int((row > value - 1e-4).sum()) + 1
        assert len(entry.top) == k
        values = list(entry.top.values())
        assert values == sorted(values, reverse=True)
        for token_id, top_value in entry.top.items():
            assert top_value == pytest.approx(row[token_id].item(), abs=1e-4)
        if k:
            assert values[-1] == pytest.approx(row.topk(k).values[-1].item(), abs=1e-4)


@pytest.fixture(scope="module")
def base(tiny_model_factory):
    return tiny_model_factory("llama")


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(512) for _ in range(rng.choice([1, 2, 9, 33, 70]))] for _ in range(count)
    ]


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(max_num_batched_tokens=16, enable_chunked_prefill=True),
        dict(num_blocks_override=16, block_size=8),
    ],
    ids=["one_chunk", "chunked", "preempted"],
)
def test_prompt_logprobs_equal_hf(base, options):
    batch = prompts(6)
    llm = LLM(str(base), dtype="float32", max_model_len=128, **options)
    plain = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    scored = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, prompt_logprobs=K)
    params = [scored if i % 2 == 0 else plain for i in range(len(batch))]
    outputs = llm.generate(batch, params)
    for i, (prompt, output) in enumerate(zip(batch, outputs, strict=True)):
        if i % 2:
            assert output.prompt_logprobs is None
            continue
        assert_matches(output.prompt_logprobs, prompt, reference(base, prompt))
    engine = llm.engine
    if "num_blocks_override" in options:
        assert engine.scheduler.num_preemptions > 0, "the KV budget did not force preemption"
    engine.kv_cache.check_invariants()
    assert engine.kv_cache.pool.num_free == engine.kv_cache.pool.num_blocks


def test_a_preemption_in_the_middle_of_the_prompt_scores_each_token_once(base, monkeypatch):
    """A long decode takes the KV blocks of a scored prompt whose chunks are half done:
    the recompute scores only the tokens not scored yet."""
    from loraplex.platform.scheduler import Scheduler

    seen: list[tuple[str, int]] = []
    preempt = Scheduler.preempt

    def recording_preempt(self, request):
        seen.append((request.request_id, len(request.prompt_logprobs)))
        preempt(self, request)

    monkeypatch.setattr(Scheduler, "preempt", recording_preempt)
    rng = random.Random(13)
    long_decode = [rng.randrange(512) for _ in range(100)]
    scored = [rng.randrange(512) for _ in range(70)]
    llm = LLM(
        str(base),
        dtype="float32",
        max_model_len=128,
        num_blocks_override=16,
        block_size=8,
        max_num_batched_tokens=4,
        enable_chunked_prefill=True,
    )
    engine = llm.engine
    engine.add_request(
        "decode", long_decode, SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True)
    )
    engine.step()
    engine.add_request("scored", scored, WANTS)
    outputs = {}
    while engine.has_unfinished():
        for output in engine.step():
            outputs[output.request_id] = output
    assert any(rid == "scored" and 0 < booked < len(scored) - 1 for rid, booked in seen), seen
    assert_matches(outputs["scored"].prompt_logprobs, scored, reference(base, scored))
    engine.kv_cache.check_invariants()
    assert engine.kv_cache.pool.num_free == engine.kv_cache.pool.num_blocks


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(base):
    """The second identical prompt would hit the prefix cache; asking for prompt
    logprobs it computes its prompt instead (and caches nothing less)."""
    prompt = prompts(1, seed=3)[0] + list(range(40))
    llm = LLM(str(base), dtype="float32", max_model_len=128, block_size=8)
    plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = llm.generate([prompt], plain)[0]
    again = llm.generate([prompt], plain)[0]
    assert again.num_cached_tokens > 0
    scored = llm.generate([prompt], WANTS)[0]
    assert scored.num_cached_tokens == 0
    assert scored.token_ids == first.token_ids
    assert_matches(scored.prompt_logprobs, prompt, reference(base, prompt))


def test_n_children_share_the_prompt_logprobs(base):
    prompt = prompts(1, seed=5)[0] + [7, 8, 9]
    llm = LLM(str(base), dtype="float32", max_model_len=128)
    params = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=5, prompt_logprobs=0)
    output = llm.generate([prompt], params)[0]
    assert len(output.outputs) == 3
    assert_matches(output.prompt_logprobs, prompt, reference(base, prompt), k=0)
    assert all(entry.top == {} for entry in output.prompt_logprobs[1:])


def test_prompt_logprobs_with_an_adapter_equal_peft(base, tmp_path, peft_adapter_factory):
    adapter = peft_adapter_factory(base, tmp_path / "qv", rank=4, seed=11)
    prompt = prompts(1, seed=7)[0] + [1, 2, 3, 4, 5]
    llm = LLM(str(base), dtype="float32", max_model_len=128, max_lora_rank=8)
    with_adapter, without = llm.generate([prompt, prompt], WANTS, adapters=[str(adapter), None])
    assert_matches(with_adapter.prompt_logprobs, prompt, reference(base, prompt, adapter))
    assert_matches(without.prompt_logprobs, prompt, reference(base, prompt))


def test_long_prompts_are_scored_in_slices(base, monkeypatch):
    """More prompt rows in one step than one slice holds: same scores."""
    monkeypatch.setattr("loraplex.platform.prompt_logprobs.LOGITS_ROWS_PER_SLICE", 7)
    prompt = prompts(1, seed=9)[0] + list(range(60))
    assert len(prompt) > 7 * 3
    llm = LLM(str(base), dtype="float32", max_model_len=256)
    output = llm.generate([prompt], WANTS)[0]
    assert_matches(output.prompt_logprobs, prompt, reference(base, prompt))
    assert LOGITS_ROWS_PER_SLICE >= 64


def test_each_position_is_scored_once():
    """Chunks and recomputation never score a prompt token twice or skip one."""
    request = Request("r", list(range(10)), WANTS)
    assert positions_to_score(request, 0, 4) == range(0, 4)
    request.prompt_logprobs.extend([None] * 4)
    assert positions_to_score(request, 4, 10) == range(4, 9)
    assert positions_to_score(request, 0, 6) == range(4, 6), "a recompute after preemption"
    request.prompt_logprobs.extend([None] * 5)
    assert positions_to_score(request, 0, 10) == range(0)
    assert not request.needs_prompt_logprobs
    plain = Request("p", list(range(10)), SamplingParams())
    assert positions_to_score(plain, 0, 10) == range(0)
