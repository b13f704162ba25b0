"""The ingress's bound on a request body (`MAX_BODY_BYTES`), answered in OpenAI error JSON
before the body is read. Behind Serve's proxy, proxy_middleware.py refuses such a body
first; on the ingress's own port (`ingress.direct_http_port`) nothing stands in front,
so the ingress must not read a body of any size into memory. Starlette's body limit
answers in plain text, hence this middleware.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraplex.deployments.errors import MAX_BODY_BYTES, OpenAIError, error_response


def _too_large() -> OpenAIError:
    return OpenAIError(413, f"request body over {MAX_BODY_BYTES} bytes")


class BodyLimit:
    """Semantics: an ASGI middleware. An HTTP request whose Content-Length is past
    `MAX_BODY_BYTES` gets 413 at once, unread; one that sends more than that without
    saying so raises a 413 `OpenAIError` from `receive` as soon as it passes the limit
    (the app's handler answers it)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
            await error_response(_too_large())(scope, receive, send)
            return
        received = 0

        async def bounded_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > MAX_BODY_BYTES:
                    raise _too_large()
            return message

        await self.app(scope, bounded_receive, send)
