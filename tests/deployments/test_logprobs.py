"""Logprobs through the session's Serve app with the `openai` SDK, on a base:adapter
model: vLLM's `prompt_logprobs` (completions per choice, chat at the top level) equal
PEFT's log-softmax at each prompt position; `echo` with `logprobs` leads a completion's
logprobs with the prompt's, streamed or not; token texts, byte values and text offsets
in OpenAI's shapes. A prompt the prefix cache holds is computed again to be scored."""

from __future__ import annotations

import pytest
import torch

MODEL = "tiny:sa"
PROMPT = [5, 17, 42, 42, 9, 300, 12, 77, 3, 150]


@pytest.fixture(scope="module")
def peft_logprobs(serve_setup):
    """PEFT's log-softmax over the vocabulary at each position of `PROMPT` (tiny + sa)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(serve_setup.base, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, serve_setup.shared["sa"]).eval()
    with torch.inference_mode():
        return model(torch.tensor([PROMPT])).logits[0].float().log_softmax(dim=-1)


def assert_scored_like_peft(entries: list, want: torch.Tensor, k: int) -> None:
    """vLLM's shape: None first, then {token id: {logprob, rank, decoded_token}} holding
    the prompt token and the top k."""
    assert len(entries) == len(PROMPT) and entries[0] is None
    for position, entry in enumerate(entries[1:]):
        row = want[position]
        token = PROMPT[position + 1]
        scored = entry[str(token)]
        value = row[token].item()
        assert scored["logprob"] == pytest.approx(value, abs=1e-4)
        assert int((row > value + 1e-4).sum()) + 1 <= scored["rank"]
        assert scored["rank"] <= int((row > value - 1e-4).sum()) + 1
        assert isinstance(scored["decoded_token"], str)
        top = sorted(
            (v for t, v in entry.items() if int(t) != token or scored["rank"] <= k),
            key=lambda v: v["rank"],
        )
        assert [v["rank"] for v in top] == list(range(1, k + 1))
        best = row.topk(k).values.tolist() if k else []
        assert [v["logprob"] for v in top] == pytest.approx(best, abs=1e-4)


def test_completion_prompt_logprobs_equal_peft(client, peft_logprobs):
    response = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=3,
        temperature=0,
        n=2,
        extra_body={"prompt_logprobs": 2},
    )
    assert len(response.choices) == 2
    for choice in response.choices:
        assert_scored_like_peft(choice.model_extra["prompt_logprobs"], peft_logprobs, k=2)
        assert choice.logprobs is None


def test_chat_prompt_logprobs_sit_at_the_top_level(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "w1 w2 w3"}],
        max_tokens=2,
        temperature=0,
        extra_body={"prompt_logprobs": 0},
    )
    entries = response.model_extra["prompt_logprobs"]
    assert len(entries) == response.usage.prompt_tokens
    assert entries[0] is None
    assert all(len(entry) == 1 for entry in entries[1:]), "k=0: the prompt token alone"


def test_a_cached_prompt_is_computed_again_to_be_scored(client, peft_logprobs):
    prompt = PROMPT + list(range(100, 140))
    for _ in range(2):
        warm = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert warm.usage.prompt_tokens_details.cached_tokens > 0
    scored = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 1}
    )
    assert scored.usage.prompt_tokens_details.cached_tokens == 0
    assert scored.choices[0].text == warm.choices[0].text
    entries = scored.choices[0].model_extra["prompt_logprobs"]
    assert_scored_like_peft(entries[: len(PROMPT)], peft_logprobs, k=1)


def test_echo_with_logprobs_leads_with_the_prompts(client, post, peft_logprobs):
    plain = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2
    )
    echoed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2, echo=True
    )
    _, decoded = post("/v1/detokenize", {"model": MODEL, "tokens": PROMPT})
    choice, base = echoed.choices[0], plain.choices[0]
    assert choice.text == decoded["prompt"] + base.text
    logprobs = choice.logprobs
    count = len(PROMPT)
    assert len(logprobs.tokens) == count + 4
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for position in range(1, count):
        token = PROMPT[position]
        want = peft_logprobs[position - 1, token].item()
        assert logprobs.token_logprobs[position] == pytest.approx(want, abs=1e-4)
        assert len(logprobs.top_logprobs[position]) <= 2
    assert logprobs.token_logprobs[count:] == pytest.approx(base.logprobs.token_logprobs)
    assert logprobs.tokens[count:] == base.logprobs.tokens
    assert logprobs.text_offset[0] == 0
    assert logprobs.text_offset[count] == len(decoded["prompt"])
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    assert base.logprobs.text_offset[0] == 0
    assert echoed.model_extra.get("prompt_logprobs") is None
    assert choice.model_extra["prompt_logprobs"][0] is None


def test_streamed_echo_with_logprobs_equals_the_body(client):
    options = dict(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=1, echo=True)
    body = client.completions.create(**options).choices[0]
    text, tokens, values, offsets = "", [], [], []
    for chunk in client.completions.create(stream=True, **options):
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                values += choice.logprobs.token_logprobs
                offsets += choice.logprobs.text_offset
    assert text == body.text
    assert tokens == body.logprobs.tokens
    assert values == pytest.approx(body.logprobs.token_logprobs)
    assert offsets == body.logprobs.text_offset


def test_chat_logprobs_carry_token_texts_and_bytes(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "w1 w2"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens == 4
    for entry in content:
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6
    text, position = response.choices[0].message.content, 0
    for entry in content:
        found = text.find(entry.token.strip(), position)
        assert found >= position, (entry.token, text)
        position = found + len(entry.token.strip())
