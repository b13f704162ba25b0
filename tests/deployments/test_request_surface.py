"""The wider OpenAI request surface through the session's Serve app, with the `openai`
SDK: content parts, tool messages, batches of prompts, echo, logit_bias,
stop_token_ids, min_tokens, the fields accepted and ignored, /v1/tokenize and
/v1/detokenize, and a 400 naming the field for each bad value."""

from __future__ import annotations

import pytest

from loraplex.deployments.protocol import IGNORED_FIELDS

MODEL = "tiny:sa"
"""A base:adapter model, so every feature is shown with an adapter in the batch."""
VOCAB = 512
"""The tiny test models' vocabulary."""


def greedy_chat(client, messages, **kwargs) -> str:
    response = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, **kwargs
    )
    return response.choices[0].message.content


def test_content_parts_read_as_their_text_joined_by_newlines(client):
    parts = [{"type": "text", "text": "w1 w2"}, {"type": "text", "text": "w3"}]
    as_parts = greedy_chat(client, [{"role": "user", "content": parts}])
    as_text = greedy_chat(client, [{"role": "user", "content": "w1 w2\nw3"}])
    assert as_parts == as_text


def test_a_tool_call_conversation_is_accepted(client):
    messages = [
        {"role": "system", "content": "w1"},
        {"role": "user", "content": "w2 w3"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": '{"q": "w4"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "w5"},
    ]
    assert isinstance(greedy_chat(client, messages), str)


def test_a_completion_batch_answers_every_prompt_at_its_index(client):
    prompts = ["w1 w2", "w3", "w4 w5 w6"]
    singles = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0)
        for p in prompts
    ]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in batch.choices] == list(range(6))
    for i, single in enumerate(singles):
        assert batch.choices[2 * i].text == batch.choices[2 * i + 1].text == single.choices[0].text
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == 2 * sum(s.usage.completion_tokens for s in singles)


def test_a_streamed_batch_reassembles_per_index(client):
    prompts = [[5, 6, 7], [8, 9]]
    full = client.completions.create(model=MODEL, prompt=prompts, max_tokens=7, temperature=0)
    texts = {0: "", 1: ""}
    usage = None
    for chunk in client.completions.create(
        model=MODEL,
        prompt=prompts,
        max_tokens=7,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
        usage = chunk.usage or usage
    assert [texts[0], texts[1]] == [c.text for c in full.choices]
    assert usage.completion_tokens == full.usage.completion_tokens == 14


def test_echo_leads_each_completion_with_the_prompt(client, post):
    plain = client.completions.create(model=MODEL, prompt="w1 w2", max_tokens=4, temperature=0)
    echoed = client.completions.create(
        model=MODEL, prompt="w1 w2", max_tokens=4, temperature=0, echo=True
    )
    assert echoed.choices[0].text == "w1 w2" + plain.choices[0].text
    ids = client.completions.create(
        model=MODEL, prompt=[5, 6, 7], max_tokens=3, temperature=0, echo=True, stream=True
    )
    text = "".join(c.choices[0].text for c in ids if c.choices)
    _, decoded = post("/v1/detokenize", {"model": MODEL, "tokens": [5, 6, 7]})
    assert text.startswith(decoded["prompt"]) and len(text) > len(decoded["prompt"])


def test_logit_bias_forces_a_token(client, post):
    response = client.completions.create(
        model=MODEL,
        prompt="w1",
        max_tokens=5,
        temperature=0,
        logit_bias={"42": 100},
        extra_body={"ignore_eos": True},
    )
    _, expected = post("/v1/detokenize", {"model": MODEL, "tokens": [42] * 5})
    assert response.choices[0].text.strip() == expected["prompt"]


def test_stop_token_ids_and_min_tokens(client, post):
    prompt = [11, 12, 13]
    plain = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    _, tokens = post(
        "/v1/tokenize",
        {"model": MODEL, "prompt": plain.choices[0].text, "add_special_tokens": False},
    )
    stop_id = tokens["tokens"][2]
    stopped = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]},
    )
    first = tokens["tokens"].index(stop_id)
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == first + 1
    held = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [stop_id], "min_tokens": first + 1},
    )
    assert held.usage.completion_tokens > first + 1


def test_the_ignored_fields_are_accepted(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "w1"}],
        max_completion_tokens=3,
        store=False,
        metadata={"team": "search"},
        service_tier="auto",
        parallel_tool_calls=True,
        prompt_cache_key="k1",
        safety_identifier="user-1",
        reasoning_effort="low",
        verbosity="low",
        modalities=["text"],
        prediction={"type": "content", "content": "w1"},
        stream_options=None,
    )
    assert response.choices[0].finish_reason in ("stop", "length")
    assert {"store", "metadata", "service_tier", "prediction"} <= set(IGNORED_FIELDS)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 100.5}}, "logit_bias"),
        ({"logit_bias": {str(VOCAB + 3): 1}}, "logit_bias"),
        ({"stop_token_ids": [VOCAB + 1]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"skip_special_tokens": [1]}, "skip_special_tokens"),
        ({"modalities": ["audio"]}, "modalities"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "image_url"),
        ({"messages": [{"role": "tool", "content": "w1"}]}, "tool_call_id"),
        ({"messages": [{"role": "user", "content": "w1", "tool_call_id": "x"}]}, "tool_call_id"),
        ({"messages": [{"role": "user"}]}, "content"),
        ({"messages": [{"role": "user", "content": "w1", "tool_calls": []}]}, "tool_calls"),
        ({"no_such_field": 1}, "no_such_field"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": 1.5}, "prompt_logprobs"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ],
)
def test_bad_chat_values_are_400_naming_the_field(post, body, param):
    request = {"model": MODEL, "messages": [{"role": "user", "content": "w1"}], "max_tokens": 2}
    status, payload = post("/v1/chat/completions", {**request, **body})
    assert status == 400, payload
    assert param in payload["error"]["message"], payload


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": ["w1", ""]}, "prompt"),
        ({"prompt": ["w1"] * 65}, "prompt"),
        ({"prompt": [[1, -2]]}, "prompt"),
        ({"echo": True, "logprobs": 6}, "logprobs"),
        ({"echo": "yes please"}, "echo"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": [1]}, "prompt_logprobs"),
        ({"prompt_logprobs": 0, "stream": True}, "prompt_logprobs"),
        ({"suffix": "w9"}, "suffix"),
        ({"min_tokens": 3, "max_tokens": 2}, "min_tokens"),
    ],
)
def test_bad_completion_values_are_400_naming_the_field(post, body, param):
    status, payload = post(
        "/v1/completions", {"model": MODEL, "prompt": "w1", "max_tokens": 2, **body}
    )
    assert status == 400, payload
    assert param in payload["error"]["message"], payload


def test_tokenize_matches_what_generation_counts(client, post):
    messages = [{"role": "user", "content": "w1 w2 w3"}]
    status, counted = post("/v1/tokenize", {"model": MODEL, "messages": messages})
    assert status == 200, counted
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert counted["count"] == len(counted["tokens"]) == chat.usage.prompt_tokens
    assert counted["max_model_len"] == 128
    status, plain = post("/tokenize", {"model": "tiny", "prompt": "w1 w2"})
    completion = client.completions.create(model="tiny", prompt="w1 w2", max_tokens=1)
    assert plain["count"] == completion.usage.prompt_tokens
    status, text = post("/detokenize", {"model": "tiny", "tokens": plain["tokens"]})
    assert status == 200 and "w1 w2" in text["prompt"]


@pytest.mark.parametrize(
    "path, body, status",
    [
        ("/v1/tokenize", {"model": MODEL}, 400),
        (
            "/v1/tokenize",
            {"model": MODEL, "prompt": "w1", "messages": [{"role": "user", "content": "w"}]},
            400,
        ),
        ("/v1/tokenize", {"model": "nope", "prompt": "w1"}, 404),
        ("/v1/detokenize", {"model": MODEL, "tokens": [VOCAB + 5]}, 400),
        ("/v1/detokenize", {"model": MODEL, "tokens": [-1]}, 400),
        ("/v1/detokenize", {"model": MODEL, "tokens": "w1"}, 400),
    ],
)
def test_bad_tokenizer_calls(post, path, body, status):
    got, payload = post(path, body)
    assert got == status, payload
    assert "error" in payload


def test_tokenize_needs_a_key_and_the_model_acl(post, tenant_keys):
    status, _ = post("/v1/tokenize", {"model": "tiny", "prompt": "w1"}, key="bad")
    assert status == 401
    status, _ = post(
        "/v1/tokenize", {"model": "tiny-qwen", "prompt": "w1"}, key=tenant_keys["globex"]
    )
    assert status == 403


def test_every_ignored_field_is_accepted_by_the_schema_and_listed_in_the_serving_docs():
    from pathlib import Path

    from loraplex.deployments.protocol import ChatCompletionRequest, CompletionRequest

    serving = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    listed = serving[serving.index("Accepted and ignored") :]
    listed = listed[: listed.index("\n\n")]
    for name, why in IGNORED_FIELDS.items():
        assert f"`{name}`" in listed, name
        top = name.split(".")[0]
        assert top in ChatCompletionRequest.model_fields, name
        if not why.startswith("(chat)"):
            assert top in CompletionRequest.model_fields, name
