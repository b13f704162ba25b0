"""ProxyMiddleware's semantics, driven over ASGI. The inner app answers what Serve's proxy
answers (its own plain-text 404 until a route exists, its plain-text 503 with
Retry-After); the end-to-end run through a real proxy is test_serve_run.py (a completion
sent the moment the port opens)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

from ray.serve._private.http_util import validate_http_proxy_callback_return

from loraplex.deployments.errors import MAX_BODY_BYTES, REFUSING_FOR_HEADER
from loraplex.deployments.proxy_middleware import (
    MAX_REFUSING_KEYS,
    HoldConfig,
    ProxyMiddleware,
    RefusalWindows,
    proxy_middlewares,
)


class ServeProxyLike:
    """Answers the proxy's own 404 for the first `not_found_answers` calls, then echoes the
    request body (or the `answer` it is given)."""

    def __init__(self, not_found_answers: int, answer: tuple[int, bytes, bytes] | None = None):
        self.not_found_answers = not_found_answers
        self.answer = answer
        self.calls = 0
        self.bodies: list[bytes] = []

    async def __call__(self, scope, receive, send) -> None:
        self.calls += 1
        if self.calls <= self.not_found_answers:
            await _plain(send, 404, f"Path '{scope['path']}' not found. Ping ...".encode())
            return
        message = await receive()
        self.bodies.append(message["body"])
        if self.answer is not None:
            status, content_type, body = self.answer
            headers = [(b"content-type", content_type), (b"retry-after", b"3")]
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        start = {"type": "http.response.start", "status": 200, "headers": []}
        await send(start)
        await send({"type": "http.response.body", "body": b"echo:", "more_body": True})
        await send({"type": "http.response.body", "body": message["body"]})


async def _plain(send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"text/plain; charset=utf-8")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _scope(path: str) -> dict:
    return {"type": "http", "method": "POST", "path": path, "headers": []}


async def _drive(middleware, path, chunks, disconnect_after_s=None):
    """Runs one request; returns (status, headers, body) or None when nothing was sent."""
    incoming: asyncio.Queue = asyncio.Queue()
    for index, chunk in enumerate(chunks):
        more = index < len(chunks) - 1
        incoming.put_nowait({"type": "http.request", "body": chunk, "more_body": more})
    if disconnect_after_s is not None:
        asyncio.get_running_loop().call_later(
            disconnect_after_s, incoming.put_nowait, {"type": "http.disconnect"}
        )
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    await middleware(_scope(path), incoming.get, send)
    if not sent:
        return None
    start = sent[0]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], dict(start["headers"]), body


def test_a_request_before_any_route_is_held_and_sent_again_with_its_body():
    inner = ServeProxyLike(not_found_answers=3)
    middleware = ProxyMiddleware(inner, HoldConfig(hold_s=10, poll_s=0.01))
    status, _, body = asyncio.run(_drive(middleware, "/v1/completions", [b'{"a":', b"1}"]))
    assert (status, body) == (200, b'echo:{"a":1}')
    assert inner.calls == 4
    assert inner.bodies == [b'{"a":1}']


def test_past_the_hold_the_answer_is_openai_json_503_starting():
    inner = ServeProxyLike(not_found_answers=10**6)
    middleware = ProxyMiddleware(inner, HoldConfig(hold_s=0.05, poll_s=0.01))
    status, headers, body = asyncio.run(_drive(middleware, "/v1/chat/completions", [b"{}"]))
    assert status == 503
    assert headers[b"retry-after"] == b"2"
    assert headers[b"content-type"] == b"application/json"
    assert int(headers[b"content-length"]) == len(body)
    error = json.loads(body)["error"]
    assert (error["type"], error["code"]) == ("service_unavailable", "starting")


def test_a_probe_is_never_held():
    inner = ServeProxyLike(not_found_answers=10**6)
    middleware = ProxyMiddleware(inner, HoldConfig(hold_s=60, poll_s=0.01))
    status, _, body = asyncio.run(asyncio.wait_for(_drive(middleware, "/health", [b""]), 5))
    assert status == 503
    assert json.loads(body)["error"]["code"] == "starting"
    assert inner.calls == 1


def test_a_client_that_leaves_during_the_hold_ends_it():
    inner = ServeProxyLike(not_found_answers=10**6)
    middleware = ProxyMiddleware(inner, HoldConfig(hold_s=60, poll_s=0.01))
    result = asyncio.run(asyncio.wait_for(_drive(middleware, "/v1/completions", [b"{}"], 0.1), 5))
    assert result is None
    assert inner.calls > 1


def test_the_proxys_plain_text_errors_become_openai_json_with_their_headers():
    answer = (503, b"text/plain; charset=utf-8", b"Request dropped due to backpressure")
    inner = ServeProxyLike(not_found_answers=0, answer=answer)
    middleware = ProxyMiddleware(inner, HoldConfig(hold_s=60, poll_s=0.01))
    status, headers, body = asyncio.run(_drive(middleware, "/v1/completions", [b"{}"]))
    assert status == 503
    assert headers[b"retry-after"] == b"3"
    assert int(headers[b"content-length"]) == len(body)
    error = json.loads(body)["error"]
    assert error["message"] == "Request dropped due to backpressure"
    assert (error["type"], error["code"]) == ("service_unavailable", "proxy_error")


def test_the_ingresss_own_errors_pass_untouched():
    ingress_error = json.dumps({"error": {"message": "no", "code": "model_not_found"}})
    answer = (404, b"application/json", ingress_error.encode())
    inner = ServeProxyLike(not_found_answers=0, answer=answer)
    middleware = ProxyMiddleware(inner, HoldConfig(hold_s=60, poll_s=0.01))
    status, headers, body = asyncio.run(_drive(middleware, "/v1/completions", [b"{}"]))
    assert (status, body) == (404, ingress_error.encode())
    assert headers[b"content-type"] == b"application/json"


def test_serve_accepts_the_callbacks_middlewares():
    middlewares = validate_http_proxy_callback_return(proxy_middlewares())
    assert [m.cls for m in middlewares] == [ProxyMiddleware]


def test_the_middleware_loads_in_the_proxy_without_torch():
    """It is imported in Serve's proxy before the port opens: no torch, no engine."""
    code = (
        "import sys, loraplex.deployments.proxy_middleware; "
        "heavy = [m for m in sys.modules if m.split('.')[0] == 'torch'"
        " or m.startswith('loraplex.platform.')]; "
        "print(heavy[:5], file=sys.stderr); sys.exit(1 if heavy else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


class IngressLike:
    """Answers the ingress's `overloaded` 503 with REFUSING_FOR_HEADER for its first
    `refusals` calls, then 200."""

    def __init__(self, refusals: int, refusing_for_ms: int):
        self.refusals = refusals
        self.refusing_for_ms = refusing_for_ms
        self.calls = 0

    async def __call__(self, scope, receive, send) -> None:
        self.calls += 1
        await receive()
        if self.calls <= self.refusals:
            body = json.dumps({"error": {"message": "at capacity", "code": "overloaded"}})
            headers = [
                (b"content-type", b"application/json"),
                (b"retry-after", b"1"),
                (REFUSING_FOR_HEADER.encode(), str(self.refusing_for_ms).encode()),
            ]
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            await send({"type": "http.response.body", "body": body.encode()})
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


async def _request(middleware, key: bytes, model: str):
    sent: list[dict] = []

    async def receive():
        body = json.dumps({"model": model, "prompt": "w1"}).encode()
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {**_scope("/v1/completions"), "headers": [(b"authorization", key)]}
    await middleware(scope, receive, send)
    return sent[0]["status"], dict(sent[0]["headers"]), sent[1]["body"]


def test_the_ingresss_refusal_window_is_answered_by_the_proxy_for_that_key_and_model():
    inner = IngressLike(refusals=1, refusing_for_ms=300)
    refused: list[int] = []
    middleware = ProxyMiddleware(inner, HoldConfig(), on_refusal=lambda: refused.append(1))

    async def scenario():
        first = await _request(middleware, b"Bearer a", "tiny")
        again = await _request(middleware, b"Bearer a", "tiny")
        other_key = await _request(middleware, b"Bearer b", "tiny")
        other_model = await _request(middleware, b"Bearer a", "tiny:sa")
        await asyncio.sleep(0.35)
        after = await _request(middleware, b"Bearer a", "tiny")
        return first, again, other_key, other_model, after

    first, again, other_key, other_model, after = asyncio.run(scenario())
    assert first[0] == 503 and REFUSING_FOR_HEADER.encode() not in first[1]
    status, headers, body = again
    assert (status, json.loads(body)["error"]["code"]) == (503, "overloaded")
    assert headers[b"retry-after"] == b"1"
    assert refused == [1]
    assert [other_key[0], other_model[0], after[0]] == [200, 200, 200]
    assert inner.calls == 4


def test_refusal_windows_stay_bounded():
    windows = RefusalWindows()
    for index in range(MAX_REFUSING_KEYS + 10):
        windows.note(f"Bearer {index}".encode(), "tiny", 60.0)
    assert b"Bearer 0" not in windows
    assert windows.remaining_s(f"Bearer {MAX_REFUSING_KEYS + 9}".encode(), "tiny") > 0
    windows.note(b"Bearer x", "tiny", 0.0)
    assert windows.remaining_s(b"Bearer x", "tiny") == 0.0
    assert b"Bearer x" not in windows


def test_a_body_past_the_limit_gets_413_before_the_app_sees_it():
    inner = ServeProxyLike(not_found_answers=0)
    middleware = ProxyMiddleware(inner, HoldConfig(hold_s=60, poll_s=0.01))
    chunks = [b"x" * (1 << 16)] * ((MAX_BODY_BYTES >> 16) + 2)
    status, _, body = asyncio.run(_drive(middleware, "/v1/completions", chunks))
    assert status == 413
    assert json.loads(body)["error"]["type"] == "invalid_request_error"
    assert inner.calls == 0
