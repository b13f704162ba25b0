"""The OpenAI surface through a real Serve app, driven by the official `openai` SDK."""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from loraplex.platform import LLM, SamplingParams


def post_raw(url: str, body: bytes, key: str | None = "sk-acme-test") -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_models_lists_the_base_models(client):
    ids = [m.id for m in client.models.list().data]
    assert ids[:4] == ["tiny", "tiny-tight", "tiny-bytes", "tiny-qwen"]


def test_completion_matches_offline_greedy(client, tiny_model_factory):
    prompt = [5, 6, 7, 8, 9]
    response = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    offline = LLM(str(tiny_model_factory("llama")), max_model_len=128, max_loras=0)
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


DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", DEEP),
        ("/v1/completions", b'{"model": "tiny", "prompt": ' + DEEP + b"}"),
        ("/v1/chat/completions", b'{"model": "tiny", "messages": ' + DEEP + b"}"),
    ],
    ids=["bare", "prompt", "messages"],
)
def test_deeply_nested_json_is_400_with_openai_error_json(serve_url, path, body):
    """100,000 nested arrays exhaust the JSON parser's recursion (RecursionError): the
    ingress answers 400 in OpenAI error JSON, not a 500."""
    status, payload = post_raw(f"{serve_url}{path}", body)
    assert status == 400, payload
    assert payload["error"]["type"] == "invalid_request_error"
    assert "too deeply" in payload["error"]["message"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/chat/completions",
            b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
        ),
        ("/v1/completions", b'{"model": "tiny", "prompt": "w1 \\udfff w2", "max_tokens": 2}'),
        (
            "/v1/completions",
            b'{"model": "tiny", "prompt": "w1", "stop": ["\\ud83d"], "max_tokens": 2}',
        ),
    ],
    ids=["chat-content", "prompt", "stop"],
)
def test_lone_surrogates_are_400_not_a_replica_failure(serve_url, path, body):
    """JSON can spell a lone UTF-16 surrogate; no UTF-8 text can, and the tokenizer
    raises on it. Bad input is a 400 naming the problem, never a 503 'replica failed'."""
    status, payload = post_raw(f"{serve_url}{path}", body)
    assert status == 400, payload
    assert payload["error"]["type"] == "invalid_request_error"
    assert "surrogate" in payload["error"]["message"]


def test_a_surrogate_pair_is_text_and_is_served(serve_url):
    """A pair of surrogate escapes is one astral character (U+1F600): valid text."""
    body = b'{"model": "tiny", "prompt": "w1 \\ud83d\\ude00", "max_tokens": 2}'
    status, payload = post_raw(f"{serve_url}/v1/completions", body)
    assert status == 200, payload
    assert payload["usage"]["completion_tokens"] == 2


def test_health(serve_url):
    with urllib.request.urlopen(f"{serve_url}/health", timeout=10) as response:
        assert json.loads(response.read()) == {"status": "ok"}


def test_missing_or_bad_key_is_401(tenant_client, serve_url):
    with pytest.raises(openai.AuthenticationError) as error:
        tenant_client(None).completions.create(model="tiny", prompt="w1", max_tokens=2)
    assert error.value.body["code"] == "invalid_api_key"
    status, payload = post_raw(f"{serve_url}/v1/completions", b"{}", key=None)
    assert status == 401 and "missing API key" in payload["error"]["message"]


def test_body_over_one_mib_is_413(serve_url):
    body = json.dumps({"model": "tiny", "prompt": "w1 " * 400_000}).encode()
    status, payload = post_raw(f"{serve_url}/v1/completions", body)
    assert status == 413 and payload["error"]["message"]


@pytest.mark.parametrize(
    "body",
    [
        {"model": "tiny", "prompt": "w1", "max_tokens": "many"},
        {"model": "tiny", "prompt": "w1", "max_tokens": 10**12},
        {"model": "tiny", "prompt": "w1", "n": 1000},
        {"model": ["tiny"], "prompt": "w1"},
        {"model": "tiny", "prompt": [1, -5]},
        {"model": "tiny", "prompt": [10**9]},
        {"model": "tiny", "prompt": ""},
    ],
)
def test_wrong_types_and_absurd_values_are_400(serve_url, body):
    status, payload = post_raw(f"{serve_url}/v1/completions", json.dumps(body).encode())
    assert status == 400, payload
    assert payload["error"]["type"] == "invalid_request_error"


def test_tenant_limits_give_429_with_retry_after(tenant_client):
    limited = tenant_client("limited")
    stream = limited.completions.create(
        model="tiny", prompt="w1 w2", max_tokens=60, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    with pytest.raises(openai.RateLimitError) as error:
        limited.completions.create(model="tiny", prompt="w1", max_tokens=2)
    assert int(error.value.response.headers["retry-after"]) >= 1
    assert "in flight" in error.value.body["message"]
    stream.close()
    # The aborted stream's tokens plus one more call exhaust 100 tokens a minute. Its
    # sequence leaves the tenant's in-flight count once the server has seen the client
    # go and aborted it: until then a call may still meet the in-flight limit (a
    # sequence never released would run into the deadline).
    deadline = time.monotonic() + 30
    while True:
        try:
            limited.completions.create(
                model="tiny", prompt="w1", max_tokens=40, extra_body={"ignore_eos": True}
            )
        except openai.RateLimitError as limit:
            if "sequences in flight and" not in limit.body["message"]:
                assert "tokens in the last minute" in limit.body["message"]
                break
            time.sleep(0.05)
        assert time.monotonic() < deadline, "token budget never enforced"


def test_overloaded_model_is_503_with_retry_after(tenant_client):
    """tiny-qwen takes one request at a time and queues one: of four concurrent long
    requests, some are served and the rest are refused with 503 and Retry-After."""
    client = tenant_client("acme")

    def long_request():
        try:
            stream = client.completions.create(
                model="tiny-qwen",
                prompt=[1, 2],
                max_tokens=600,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        except openai.InternalServerError as error:
            return error
        stream.close()
        return None

    with ThreadPoolExecutor(4) as pool:
        outcomes = list(pool.map(lambda _: long_request(), range(4)))
    refused = [o for o in outcomes if o is not None]
    assert refused and len(refused) < 4, outcomes
    for error in refused:
        assert error.status_code == 503 and "overloaded" in error.body["message"]
        assert int(error.response.headers["retry-after"]) >= 1
