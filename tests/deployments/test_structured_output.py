"""Structured output through the session's Serve app with the `openai` SDK, on
`tiny-bytes` (a byte-level tokenizer that can spell JSON) and its adapter `sj`:
`response_format` (json_schema, json_object) and vLLM's `structured_outputs` (json,
regex, choice, grammar), streamed and not, guided and unguided requests at once, and a
400 naming the field for each bad value."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "population": {"type": "integer", "minimum": 0, "maximum": 9999},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "city", "schema": SCHEMA, "strict": True},
}
MESSAGES = [{"role": "user", "content": "Describe a city as JSON."}]


@pytest.mark.parametrize("model", ["tiny-bytes", "tiny-bytes:sj"])
def test_response_format_json_schema_validates(client, model):
    response = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=96,
        temperature=0,
        response_format=RESPONSE_FORMAT,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_a_streamed_guided_answer_validates(client):
    stream = client.chat.completions.create(
        model="tiny-bytes:sj",
        messages=MESSAGES,
        max_tokens=96,
        temperature=0.7,
        seed=3,
        response_format=RESPONSE_FORMAT,
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_gives_an_object(client):
    response = client.chat.completions.create(
        model="tiny-bytes",
        messages=MESSAGES,
        max_tokens=64,
        temperature=0,
        response_format={"type": "json_object"},
    )
    choice = response.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.finish_reason == "length" and choice.message.content.startswith("{")


@pytest.mark.parametrize(
    "structured, check",
    [
        ({"regex": r"[0-9]{2}-[a-z]{3}"}, lambda t: re.fullmatch(r"[0-9]{2}-[a-z]{3}", t)),
        ({"choice": ["alpha", "beta", "gamma"]}, lambda t: t in ("alpha", "beta", "gamma")),
        ({"grammar": 'root ::= "id:" [0-9] [0-9]'}, lambda t: re.fullmatch(r"id:\d\d", t)),
        (
            {"json": json.dumps(SCHEMA)},
            lambda t: jsonschema.validate(json.loads(t), SCHEMA) or True,
        ),
    ],
)
def test_structured_outputs_on_completions(client, structured, check):
    response = client.completions.create(
        model="tiny-bytes:sj",
        prompt="Answer:",
        max_tokens=64,
        temperature=0,
        extra_body={"structured_outputs": structured},
    )
    assert response.choices[0].finish_reason == "stop"
    assert check(response.choices[0].text), response.choices[0].text


def test_guided_and_unguided_requests_at_once(client):
    """Unguided answers are the same alone and while guided ones (base and adapter) run
    beside them; every guided one validates."""

    def unguided(_=None) -> str:
        return (
            client.completions.create(
                model="tiny-bytes",
                prompt="Once",
                max_tokens=12,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .text
        )

    def guided(model: str) -> str:
        return (
            client.chat.completions.create(
                model=model,
                messages=MESSAGES,
                max_tokens=96,
                temperature=0,
                response_format=RESPONSE_FORMAT,
            )
            .choices[0]
            .message.content
        )

    alone = unguided()
    with ThreadPoolExecutor(8) as pool:
        plain = [pool.submit(unguided) for _ in range(4)]
        shaped = [pool.submit(guided, m) for m in ["tiny-bytes", "tiny-bytes:sj"] * 2]
        assert [f.result() for f in plain] == [alone] * 4
        for future in shaped:
            jsonschema.validate(json.loads(future.result()), SCHEMA)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "json_schema"),
        (
            {
                "response_format": {
                    "type": "json_object",
                    "json_schema": RESPONSE_FORMAT["json_schema"],
                }
            },
            "json_schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "bad name!", "schema": SCHEMA},
                }
            },
            "name",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                }
            },
            "json_schema",
        ),
        ({"structured_outputs": {"regex": "(unclosed"}}, "regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
        ({"structured_outputs": {}}, "exactly one"),
        ({"structured_outputs": {"choice": []}}, "choice"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
        ({"structured_outputs": {"json": "[1, 2]"}}, "structured_outputs.json"),
        ({"structured_outputs": {"grammar": "root ::= missing"}}, "grammar"),
        (
            {"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}},
            "not both",
        ),
    ],
)
def test_bad_structured_output_values_are_400(post, body, param):
    request = {"model": "tiny-bytes", "messages": MESSAGES, "max_tokens": 8}
    status, payload = post("/v1/chat/completions", {**request, **body})
    assert status == 400, payload
    assert param in payload["error"]["message"], payload


def test_a_structure_the_vocabulary_cannot_spell_is_a_400(post):
    """`tiny`'s word-level tokenizer has no digits."""
    body = {
        "model": "tiny",
        "prompt": "w1",
        "max_tokens": 8,
        "structured_outputs": {"regex": "[0-9]+"},
    }
    status, payload = post("/v1/completions", body)
    assert status == 400, payload
    assert "vocabulary" in payload["error"]["message"]
