"""The OpenAI surface through a real Serve app, driven by the official `openai` SDK."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest

from loraplex.platform import LLM, SamplingParams


def post_raw(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_models_lists_the_base_model(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_completion_matches_offline_greedy(client, tiny_model_factory):
    prompt = [5, 6, 7, 8, 9]
    response = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    offline = LLM(str(tiny_model_factory("llama")), max_model_len=128)
    (expected,) = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=8))
    assert response.choices[0].text == expected.text
    assert response.usage.prompt_tokens == 5
    assert response.usage.completion_tokens == len(expected.token_ids)


def test_streamed_chunks_reassemble_to_the_full_text(client):
    kwargs = dict(model="tiny", prompt="w1 w2 w3", max_tokens=10, temperature=0)
    full = client.completions.create(**kwargs).choices[0].text
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10


def test_chat_completion_and_stream(client):
    messages = [{"role": "user", "content": "w3 w4"}]
    full = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0
    )
    assert full.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == full.choices[0].message.content


def test_n_and_seed(client):
    response = client.completions.create(
        model="tiny", prompt="w9", max_tokens=5, n=3, temperature=1.0, seed=11
    )
    assert sorted(c.index for c in response.choices) == [0, 1, 2]
    again = client.completions.create(
        model="tiny", prompt="w9", max_tokens=5, n=3, temperature=1.0, seed=11
    )
    assert [c.text for c in again.choices] == [c.text for c in response.choices]


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="nope", prompt="w1", max_tokens=2)
    assert error.value.body["code"] == "model_not_found"


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=5), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(extra_body={"no_such_field": 1}), "no_such_field"),
    ],
)
def test_invalid_parameters_are_400(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="tiny", prompt="w1", **{"max_tokens": 2, **kwargs})
    assert param in error.value.body["message"]


def test_prompt_too_long_is_400(client):
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model="tiny", prompt=list(range(1, 200)), max_tokens=2)


@pytest.mark.parametrize(
    "body",
    [b"{not json", b"\xff\xfe\x00garbage", b"[1, 2]", b'{"model": "tiny", "prompt": 5}'],
)
def test_malformed_bodies_are_400_with_openai_error_json(serve_url, body):
    status, payload = post_raw(f"{serve_url}/v1/completions", body)
    assert status == 400
    assert payload["error"]["type"] == "invalid_request_error"
    assert payload["error"]["message"]


def test_health(serve_url):
    with urllib.request.urlopen(f"{serve_url}/health", timeout=10) as response:
        assert json.loads(response.read()) == {"status": "ok"}
