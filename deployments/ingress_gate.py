"""The ingress's own bound on the requests it works on, answered in OpenAI error JSON.

Past its `max_ongoing_requests` Ray Serve's HTTP proxy queues a request for the
ingress, and past `max_queued_requests` answers 503 itself (Serve's plain text, which
proxy_middleware.py turns into OpenAI error JSON with a generic message). The ingress
therefore bounds itself first: Serve's limit on an ingress replica is
`ingress.max_ongoing_requests + INGRESS_HEADROOM` (app.py), and this middleware answers
the request past `ingress.max_ongoing_requests` at once with 503 `overloaded`, OpenAI
error JSON and Retry-After, before its body is read. The headroom carries these
refusals and the probes (`/health`, `/metrics`, which the gate never counts), so the
proxy's own 503 is left for an ingress that cannot take requests at all (dead,
or its event loop stalled). A stream counts until it ends.

One ingress replica per process, and its requests all run on one event loop: the
count needs no lock.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from loraplex.deployments.errors import OpenAIError, error_response

logger = logging.getLogger(__name__)

INGRESS_HEADROOM = 64
"""Serve's places on an ingress replica above its own bound (module docstring)."""
UNCOUNTED_PATHS = frozenset({"/health", "/metrics"})
RETRY_AFTER_S = 2


@dataclass
class GateState:
    limit: int | None = None
    """None until the ingress replica sets it: nothing is refused."""
    in_flight: int = 0
    refused: int = 0


GATE = GateState()


def set_gate_limit(limit: int) -> None:
    """Sets this process's bound. The ingress calls this function rather than writing
    `GATE` itself: Serve ships the ingress class by value, with copies of the module
    objects its methods name, while a function of this module is shipped by reference
    and writes the `GATE` the middleware reads."""
    GATE.limit = limit


class InFlightGate:
    """ASGI middleware enforcing `GATE.limit` (module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or GATE.limit is None or _uncounted(scope):
            await self.app(scope, receive, send)
            return
        if GATE.in_flight >= GATE.limit:
            GATE.refused += 1
            if GATE.refused % 1000 == 1:
                logger.warning(
                    "ingress at its bound of %d requests: refused %d so far",
                    GATE.limit,
                    GATE.refused,
                )
            refusal = OpenAIError(
                503,
                "the server is at capacity, retry later",
                code="overloaded",
                retry_after_s=RETRY_AFTER_S,
            )
            await error_response(refusal)(scope, receive, send)
            return
        GATE.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            GATE.in_flight -= 1


def _uncounted(scope: Scope) -> bool:
    path = scope.get("path", "")
    root = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :]
    return path in UNCOUNTED_PATHS
