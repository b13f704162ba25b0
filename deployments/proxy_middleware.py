"""ASGI middleware that runs inside Ray Serve's HTTP proxy, so that nothing a client meets
on port 8000 is Serve's own plain text.

Serve's proxy answers some requests itself, before any loraplex code runs:
- 404 "Path '...' not found" while no application is routed: the first seconds after the
  port opens (`serve run` starts the proxy, then the controller imports and builds the
  app), and while an application is deleted or renamed;
- 408 / 429 / 503 (and 500) in plain text when a call to the ingress fails before it
  answers (timeouts, Serve's own back-pressure, no replica).

`ProxyMiddleware` holds a request that met the proxy's own 404 and sends it again every
`poll_s` until a route answers it, for at most `hold_s` (`LORAPLEX_PROXY_HOLD_S`, 60 s by
default), so a completion sent the moment the port answers gets its answer. Past the
hold, and at once for `/health` and `/metrics` (a probe must not wait), it answers 503
`starting` in OpenAI's error JSON with Retry-After. Every other plain-text error of the
proxy becomes OpenAI's error JSON with the same status and headers. A body past
`MAX_BODY_BYTES` gets 413 as soon as it is past, before the ingress sees any of it.

It also refuses, by itself, what the ingress just said it would refuse: an `overloaded`
503 from the ingress carries `x-loraplex-refusing-for-ms` (errors.REFUSING_FOR_HEADER:
how long the ingress's admission estimate expects to refuse a one-sequence request of
the same tenant for the same model). For that long the proxy answers the same 503 to
the same bearer key and `model`, without calling the ingress, so that under overload a
refusal costs neither the proxy's call to the ingress nor the ingress's CPU, on the
cores the engine computes on. The header never reaches the client.

Serve installs it from `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`
(`...proxy_middleware:proxy_middlewares`), which must be in the proxy process's environment:
serve_config.yaml sets it in `controller_options.runtime_env.env_vars`, which the
controller's proxy actors inherit. This module imports no torch and no engine code: it
loads in the proxy before the port opens.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.middleware import Middleware

from loraplex.deployments.errors import MAX_BODY_BYTES, REFUSING_FOR_HEADER, error_body

logger = logging.getLogger(__name__)

HOLD_ENV = "LORAPLEX_PROXY_HOLD_S"
DEFAULT_HOLD_S = 60.0
STARTING_RETRY_AFTER_S = 2
# Paths a probe or a scraper calls: they get the answer at once, never a hold.
NO_HOLD_PATHS = frozenset({"/health", "/metrics"})
# The proxy's own 404 body starts with this (ray/serve/_private/proxy.py not_found_response).
PROXY_NOT_FOUND_PREFIX = b"Path '"
REFUSING_FOR = REFUSING_FOR_HEADER.encode()
MAX_REFUSING_KEYS = 4096
"""Bearer keys with a refusal window kept at once; past it the table starts over."""

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True)
class HoldConfig:
    hold_s: float = DEFAULT_HOLD_S
    poll_s: float = 0.25

    @classmethod
    def from_env(cls) -> HoldConfig:
        raw = os.environ.get(HOLD_ENV)
        if raw is None:
            return cls()
        try:
            hold_s = float(raw)
        except ValueError:
            logger.warning("%s=%r is not a number; holding %.0f s", HOLD_ENV, raw, DEFAULT_HOLD_S)
            return cls()
        return cls(hold_s=max(0.0, hold_s))


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for key, value in headers:
        if key.lower() == name:
            return value
    return None


def _is_plain_text_error(start: Message) -> bool:
    content_type = _header(list(start.get("headers", [])), b"content-type") or b""
    return start["status"] >= 400 and content_type.startswith(b"text/plain")


class RefusalWindows:
    """Semantics: per bearer key and `model`, the monotonic time until which the ingress
    expects to refuse them (`note`); `remaining_s` is 0 outside a window. Expired
    windows are dropped when read; at most MAX_REFUSING_KEYS keys are kept."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._until: dict[bytes, dict[str, float]] = {}

    def __contains__(self, key: bytes) -> bool:
        return key in self._until

    def note(self, key: bytes, model: str, for_s: float) -> None:
        if key not in self._until and len(self._until) >= MAX_REFUSING_KEYS:
            self._until.clear()
        self._until.setdefault(key, {})[model] = self._clock() + for_s

    def remaining_s(self, key: bytes, model: str) -> float:
        windows = self._until.get(key)
        if not windows:
            return 0.0
        now = self._clock()
        remaining = windows.get(model, 0.0) - now
        if remaining > 0:
            return remaining
        for name in [name for name, until in windows.items() if until <= now]:
            del windows[name]
        if not windows:
            del self._until[key]
        return 0.0


def _authorization(scope: Scope) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == b"authorization":
            return value
    return None


def _model_of(body: bytes) -> str | None:
    try:
        model = json.loads(body).get("model")
    except (ValueError, AttributeError):
        return None
    return model if isinstance(model, str) else None


class _Captured:
    """One response of the inner app, buffered when it is the proxy's plain-text error
    and passed through as it comes otherwise."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.start: Message | None = None
        self.plain_error = False
        self.body = bytearray()
        self.refusing_for_s = 0.0
        """From the ingress's `overloaded` 503 (REFUSING_FOR_HEADER), removed from it."""

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            if message["status"] == 503:
                message = self._take_refusing_for(message)
            self.start = message
            self.plain_error = _is_plain_text_error(message)
            if not self.plain_error:
                await self._send(message)
            return
        if message["type"] == "http.response.body" and self.plain_error:
            self.body += message.get("body", b"")
            return
        await self._send(message)

    def _take_refusing_for(self, start: Message) -> Message:
        headers = list(start.get("headers", []))
        value = _header(headers, REFUSING_FOR)
        if value is None:
            return start
        try:
            self.refusing_for_s = max(0.0, float(value) / 1e3)
        except ValueError:
            self.refusing_for_s = 0.0
        kept = [(key, v) for key, v in headers if key.lower() != REFUSING_FOR]
        return {**start, "headers": kept}

    @property
    def is_proxy_not_found(self) -> bool:
        return (
            self.plain_error
            and self.start is not None
            and self.start["status"] == 404
            and bytes(self.body).startswith(PROXY_NOT_FOUND_PREFIX)
        )


async def _send_json_error(
    send: Send,
    status: int,
    message: str,
    code: str | None,
    extra_headers: Sequence[tuple[bytes, bytes]] = (),
) -> None:
    body = json.dumps(error_body(status, message, None, code)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *extra_headers,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _send_as_openai_error(send: Send, captured: _Captured) -> None:
    """The proxy's plain-text error, same status and headers, as OpenAI's error JSON."""
    assert captured.start is not None
    status = captured.start["status"]
    kept = [
        (key, value)
        for key, value in captured.start.get("headers", [])
        if key.lower() not in (b"content-type", b"content-length")
    ]
    message = bytes(captured.body).decode(errors="replace").strip() or f"HTTP {status}"
    await _send_json_error(send, status, message, "proxy_error", kept)


class ProxyMiddleware:
    """Semantics: an ASGI app around Serve's proxy app. Holds the proxy's own 404 (no
    route yet) up to `config.hold_s` and replays the request; turns every other
    plain-text error of the proxy into OpenAI's error JSON. Non-HTTP scopes and every
    response that is not the proxy's plain-text error pass through untouched."""

    def __init__(
        self,
        app: ASGIApp,
        config: HoldConfig | None = None,
        on_refusal: Callable[[], None] | None = None,
    ) -> None:
        self.app = app
        self.config = config or HoldConfig.from_env()
        self.refusals = RefusalWindows()
        self._on_refusal = on_refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client = await _ReplayableClient.read(receive)
        if client is None:
            return
        if client.too_large:
            message = f"request body over {MAX_BODY_BYTES} bytes"
            await _send_json_error(send, 413, message, None)
            return
        key = _authorization(scope)
        if key is not None and key in self.refusals:
            model = _model_of(client.body)
            remaining = 0.0 if model is None else self.refusals.remaining_s(key, model)
            if remaining > 0:
                await self._refuse(send, remaining)
                return
        deadline = time.monotonic() + self.config.hold_s
        hold = scope.get("path") not in NO_HOLD_PATHS
        try:
            while True:
                captured = _Captured(send)
                await self.app(scope, client.replay(), captured)
                if captured.refusing_for_s > 0 and key is not None:
                    model = _model_of(client.body)
                    if model is not None:
                        self.refusals.note(key, model, captured.refusing_for_s)
                if not captured.is_proxy_not_found:
                    if captured.plain_error:
                        await _send_as_openai_error(send, captured)
                    return
                if not hold or time.monotonic() >= deadline:
                    await _send_json_error(
                        send,
                        503,
                        "no application answers here yet: the platform is starting or "
                        "being redeployed; retry shortly",
                        "starting",
                        [(b"retry-after", str(STARTING_RETRY_AFTER_S).encode())],
                    )
                    return
                if await client.left_within(self.config.poll_s):
                    return
        finally:
            client.close()

    async def _refuse(self, send: Send, remaining_s: float) -> None:
        if self._on_refusal is not None:
            self._on_refusal()
        await _send_json_error(
            send,
            503,
            "the model is at capacity: this request could not start in time, retry later",
            "overloaded",
            [(b"retry-after", str(max(1, math.ceil(remaining_s))).encode())],
        )


class _ReplayableClient:
    """One HTTP client's receive channel, with its whole body kept so a held request can
    be sent again, and at most one receive outstanding at a time (the hold listens for
    a disconnect, the inner app for what follows the body)."""

    def __init__(self, body: bytes, receive: Receive) -> None:
        self.body = body
        self.too_large = False
        self._receive = receive
        self._next: asyncio.Future[Message] | None = None

    @classmethod
    async def read(cls, receive: Receive) -> _ReplayableClient | None:
        """The client with its body read (None when it left first). A body past
        MAX_BODY_BYTES is not kept: the client comes back with `too_large` set."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                client = cls(b"", receive)
                client.too_large = True
                return client
            chunks.append(chunk)
            if not message.get("more_body", False):
                return cls(b"".join(chunks), receive)

    def replay(self) -> Receive:
        """A receive for one attempt: the body, then what the client sends next."""
        body_sent = False

        async def receive() -> Message:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": self.body, "more_body": False}
            message = await asyncio.shield(self._next_message())
            self._next = None
            return message

        return receive

    def _next_message(self) -> asyncio.Future[Message]:
        if self._next is None:
            self._next = asyncio.ensure_future(self._receive())
        return self._next

    async def left_within(self, timeout_s: float) -> bool:
        """Waits up to `timeout_s`; True when the client disconnected meanwhile (the
        message stays for the next attempt otherwise)."""
        waiting = self._next_message()
        done, _ = await asyncio.wait({waiting}, timeout=timeout_s)
        return bool(done) and waiting.result().get("type") == "http.disconnect"

    def close(self) -> None:
        if self._next is not None and not self._next.done():
            self._next.cancel()


def proxy_middlewares() -> list[Middleware]:
    """Serve's proxy callback (`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`)."""
    from ray.util import metrics

    config = HoldConfig.from_env()
    refused = metrics.Counter(
        "loraplex_proxy_refusals_total",
        "Requests the HTTP proxy refused as overloaded without calling the ingress",
    )
    logger.info("loraplex proxy middleware: hold up to %.0f s for a route", config.hold_s)
    return [Middleware(ProxyMiddleware, config=config, on_refusal=refused.inc)]
