"""One JSON call to the app over real HTTP, as a client without an SDK makes it: the
admin API, registration and the like, where tests need the status, body and headers."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from email.message import Message


def api_call(
    url: str, key: str, method: str, path: str, body: dict | None = None
) -> tuple[int, dict, Message]:
    """(status, JSON body, headers) of `method path` with bearer `key`."""
    request = urllib.request.Request(
        f"{url}{path}",
        data=json.dumps(body).encode() if body is not None else None,
        method=method,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read()), response.headers
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), error.headers
