"""The fuzzer's hand list: what schema-driven generation misses. Raw bytes, so nothing
on the client side repairs them: nesting past any parser's depth, bodies at and past the
size limit, NaN and Infinity, token ids out of range, lone surrogates and invalid UTF-8,
duplicate keys, wrong content types and methods, odd keys and paths, and every bounded
field of the request schemas at and just past its bounds.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

MIB = 1 << 20


@dataclass(frozen=True)
class RawCase:
    name: str
    method: str
    path: str
    body: bytes | None = None
    content_type: str | None = "application/json"
    key: str | None = "valid"
    """'valid' (the caller's key), None (no Authorization header) or a literal key."""


def _json(value: object) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


def completion(model: str, **fields: object) -> dict:
    return {"model": model, "prompt": "w1 w2", "max_tokens": 2, **fields}


def chat(model: str, **fields: object) -> dict:
    messages = [{"role": "user", "content": "w1 w2"}]
    return {"model": model, "messages": messages, "max_tokens": 2, **fields}


def _structural(model: str) -> Iterator[RawCase]:
    deep = b"[" * 100_000 + b"]" * 100_000
    yield RawCase("deep arrays as the body", "POST", "/v1/completions", deep)
    yield RawCase(
        "deep objects as the body",
        "POST",
        "/v1/completions",
        b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
    )
    yield RawCase(
        "deep arrays as the prompt",
        "POST",
        "/v1/completions",
        b'{"model": "%s", "prompt": %s}' % (model.encode(), deep),
    )
    yield RawCase(
        "deep arrays as messages",
        "POST",
        "/v1/chat/completions",
        b'{"model": "%s", "messages": %s}' % (model.encode(), deep),
    )
    yield RawCase(
        "500-deep arrays as the prompt",
        "POST",
        "/v1/completions",
        _json(completion(model, prompt=json.loads("[" * 500 + "]" * 500))),
    )
    yield RawCase(
        "body just over 1 MiB",
        "POST",
        "/v1/completions",
        _json(completion(model, prompt="w1 " * (MIB // 3 + 10))),
    )
    yield RawCase(
        "prompt string just under 1 MiB",
        "POST",
        "/v1/completions",
        _json(completion(model, prompt="w1 " * (MIB // 3 - 100))),
    )
    yield RawCase(
        "prompt of 150k token ids",
        "POST",
        "/v1/completions",
        _json(completion(model, prompt=[1] * 150_000)),
    )
    yield RawCase(
        "10k messages",
        "POST",
        "/v1/chat/completions",
        _json(chat(model, messages=[{"role": "user", "content": "w1"}] * 10_000)),
    )
    yield RawCase(
        "1000 stop strings", "POST", "/v1/completions", _json(completion(model, stop=["w9"] * 1000))
    )
    yield RawCase("empty body", "POST", "/v1/completions", b"")
    yield RawCase("JSON null", "POST", "/v1/completions", b"null")
    yield RawCase("JSON string", "POST", "/v1/completions", b'"w1"')
    yield RawCase("truncated JSON", "POST", "/v1/completions", _json(completion(model))[:-3])
    yield RawCase("trailing garbage", "POST", "/v1/completions", _json(completion(model)) + b"}}")
    yield RawCase(
        "duplicate keys",
        "POST",
        "/v1/completions",
        b'{"model": "%s", "model": "nope", "prompt": "w1", "max_tokens": 2}' % model.encode(),
    )
    yield RawCase(
        "duplicate keys, last wins",
        "POST",
        "/v1/completions",
        b'{"model": "nope", "model": "%s", "prompt": "w1", "max_tokens": 2}' % model.encode(),
    )


def _numbers(model: str) -> Iterator[RawCase]:
    for field in ("temperature", "top_p", "max_tokens", "seed", "n", "presence_penalty"):
        for literal in (b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999"):
            body = b'{"model": "%s", "prompt": "w1", "%s": %s}' % (
                model.encode(),
                field.encode(),
                literal,
            )
            yield RawCase(f"{field} = {literal.decode()}", "POST", "/v1/completions", body)
    for ids in ([-1], [2**31], [2**63], [10**30], [1.5], ["1"], [None], [True]):
        yield RawCase(
            f"prompt ids {ids}", "POST", "/v1/completions", _json(completion(model, prompt=ids))
        )
    for value in (0, -1, 2**63, 10**30, 1.5, "5", True, None):
        yield RawCase(
            f"max_tokens = {value!r}",
            "POST",
            "/v1/completions",
            _json(completion(model, max_tokens=value)),
        )


def _text(model: str) -> Iterator[RawCase]:
    escapes = {
        "lone high surrogate": b"\\ud800",
        "lone low surrogate": b"\\udfff",
        "reversed pair": b"\\ude00\\ud83d",
        "NUL": b"\\u0000",
        "pair (valid)": b"\\ud83d\\ude00",
    }
    places = {
        "the prompt": ("/v1/completions", b'{"model": "%s", "prompt": "w1 %s", "max_tokens": 2}'),
        "a message": (
            "/v1/chat/completions",
            b'{"model": "%s", "messages": [{"role": "user", "content": "%s"}], "max_tokens": 2}',
        ),
        "a stop string": (
            "/v1/completions",
            b'{"model": "%s", "prompt": "w1", "stop": ["%s"], "max_tokens": 2}',
        ),
        "the model": ("/v1/completions", b'{"model": "%s%s", "prompt": "w1"}'),
        "a key": ("/v1/completions", b'{"model": "%s", "prompt": "w1", "%s": 1}'),
    }
    for what, escape in escapes.items():
        for place, (path, template) in places.items():
            body = template % (model.encode(), escape)
            yield RawCase(f"{what} in {place}", "POST", path, body)
    for raw in (b"\xff\xfe", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80"):
        yield RawCase(
            f"invalid UTF-8 {raw!r} in the prompt",
            "POST",
            "/v1/completions",
            b'{"model": "%s", "prompt": "w1 %s"}' % (model.encode(), raw),
        )
    for name in (
        "",
        ":",
        f"{model}:",
        f":{model}",
        f"{model}:../../etc/passwd",
        f"{model}:" + "a" * 1000,
        f"{model}:sa:sb",
        f"{model}:%2e%2e",
        "../" * 50,
        "\u202e" + model,
    ):
        yield RawCase(f"model {name[:40]!r}", "POST", "/v1/completions", _json(completion(name)))


def _messages(model: str) -> Iterator[RawCase]:
    for messages in (
        [],
        [{"role": "bogus", "content": "w1"}],
        [{"role": "user"}],
        [{"role": "user", "content": None}],
        [{"role": "user", "content": 5}],
        [{"content": "w1"}],
        ["w1"],
        [{"role": "user", "content": "w1", "extra": 1}],
    ):
        yield RawCase(
            f"messages {json.dumps(messages)[:50]}",
            "POST",
            "/v1/chat/completions",
            _json(chat(model, messages=messages)),
        )


def _protocol(model: str) -> Iterator[RawCase]:
    body = _json(completion(model))
    for content_type in (
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        None,
    ):
        yield RawCase(f"content type {content_type}", "POST", "/v1/completions", body, content_type)
    yield RawCase(
        "form body",
        "POST",
        "/v1/completions",
        b"model=x&prompt=y",
        "application/x-www-form-urlencoded",
    )
    for method in ("PUT", "PATCH", "DELETE", "GET"):
        yield RawCase(
            f"{method} /v1/completions",
            method,
            "/v1/completions",
            body if method != "GET" else None,
        )
    for path in (
        "/v1/nope",
        "/v2/completions",
        "/v1/completions/extra",
        "/%2e%2e/etc/passwd",
        "/v1/adapters/" + "a" * 2000 + "/b",
    ):
        yield RawCase(f"unknown path {path[:40]}", "GET", path, None)
    yield RawCase(
        "unknown field", "POST", "/v1/completions", _json(completion(model, frobnicate=1))
    )
    for key in (None, "", "sk-wrong", "x" * 8000, "Basic dXNlcjpwYXNz", "\u00e9"):
        yield RawCase(f"key {str(key)[:20]!r}", "POST", "/v1/completions", body, key=key)
    for path in ("../../x", "/etc/passwd", "a/../../b", "", ".", "a" * 2000, "x\u0000y"):
        register = {"model": model, "name": "fuzz", "path": path}
        yield RawCase(f"register path {path[:30]!r}", "POST", "/v1/adapters", _json(register))
    for name in ("../x", "a/b", "", "a" * 200, ".hidden", "x y"):
        register = {"model": model, "name": name, "path": "nowhere"}
        yield RawCase(f"register name {name[:30]!r}", "POST", "/v1/adapters", _json(register))
    for path in (
        f"/v1/adapters/{model}/nope",
        f"/v1/adapters/{model}/%2e%2e",
        "/v1/adapters/nope/nope",
    ):
        yield RawCase(f"DELETE {path}", "DELETE", path, None)
        yield RawCase(f"unload {path}", "POST", path + "/unload", None)


def _schema_bounds(schemas: Mapping[str, dict], model: str) -> Iterator[RawCase]:
    """Each bounded field of the completion and chat schemas at and just past its bounds
    (numbers: minimum / maximum; strings: lengths; arrays: item counts)."""
    bases = {
        "CompletionRequest": ("/v1/completions", completion(model)),
        "ChatCompletionRequest": ("/v1/chat/completions", chat(model)),
    }
    for schema_name, (path, base) in bases.items():
        properties = schemas.get(schema_name, {}).get("properties", {})
        for field, spec in properties.items():
            for value in _bound_values(spec):
                yield RawCase(
                    f"{schema_name}.{field} = {str(value)[:30]}",
                    "POST",
                    path,
                    _json({**base, field: value}),
                )


def _bound_values(spec: dict) -> Iterator[object]:
    for option in spec.get("anyOf", [spec]):
        if option.get("type") in ("integer", "number"):
            step = 1 if option["type"] == "integer" else 1e-6
            for key, outward in (("minimum", -step), ("maximum", step)):
                if key in option:
                    yield option[key]
                    yield option[key] + outward
            for key, inward in (("exclusiveMinimum", step), ("exclusiveMaximum", -step)):
                if key in option:
                    yield option[key]
                    yield option[key] + inward
        elif option.get("type") == "string":
            if "maxLength" in option:
                yield "w" * option["maxLength"]
                yield "w" * (option["maxLength"] + 1)
            if option.get("minLength"):
                yield "w" * (option["minLength"] - 1)
        elif option.get("type") == "array" and "maxItems" in option:
            yield ["w1"] * option["maxItems"]
            yield ["w1"] * (option["maxItems"] + 1)


def hand_cases(model: str, schemas: Mapping[str, dict]) -> list[RawCase]:
    """Every hand case against base model `model`; `schemas` is the OpenAPI document's
    components/schemas (for the bounds)."""
    return [
        *_structural(model),
        *_numbers(model),
        *_text(model),
        *_messages(model),
        *_protocol(model),
        *_schema_bounds(schemas, model),
    ]
