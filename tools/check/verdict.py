"""What a probe may get back: 2xx; a 4xx whose body is OpenAI error JSON; a 503 (a
genuine overload) with `Retry-After` and OpenAI error JSON; a 429 with `Retry-After`.
Anything else (any other 5xx, a 4xx without the error JSON, a dropped connection, a
timeout) is unexpected and counts as a failure."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

RETRY_STATUSES = (429, 503)


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    reason: str
    """'ok', or what was wrong (for the report)."""


def is_openai_error(body: bytes) -> bool:
    """Whether `body` is {"error": {"message": str, "type": str, ...}}."""
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, ValueError):
        return False
    error = payload.get("error") if isinstance(payload, dict) else None
    return (
        isinstance(error, dict)
        and isinstance(error.get("message"), str)
        and isinstance(error.get("type"), str)
    )


def judge(status: int, headers: Mapping[str, str], body: bytes) -> Verdict:
    """The verdict on one answer; `headers` with lowercase names."""
    if 200 <= status < 300:
        return Verdict(True, "ok")
    if status in RETRY_STATUSES and "retry-after" not in headers:
        return Verdict(False, f"{status} without Retry-After")
    if 400 <= status < 500 or status == 503:
        if is_openai_error(body):
            return Verdict(True, "ok")
        return Verdict(False, f"{status} without OpenAI error JSON: {body[:120]!r}")
    return Verdict(False, f"unexpected status {status}: {body[:200]!r}")
