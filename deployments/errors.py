"""OpenAI's error JSON: {"error": {"message", "type", "param", "code"}} with a status."""

from __future__ import annotations

from fastapi.responses import JSONResponse

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


MAX_BODY_BYTES = 1 << 20
"""The largest request body read: Serve's HTTP proxy (proxy_middleware.py) answers 413
past it before the body reaches the ingress, and the ingress checks it again."""

REFUSING_FOR_HEADER = "x-loraplex-refusing-for-ms"
"""On an `overloaded` 503 of the ingress: how long it expects to refuse the same tenant's
requests for the same model. Serve's proxy (proxy_middleware.py) refuses those itself
meanwhile, and strips the header."""


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
        refusing_for_s: float = 0.0,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s
        self.refusing_for_s = refusing_for_s


def error_body(status: int, message: str, param: str | None, code: str | None) -> dict:
    """OpenAI's error JSON for `status` (the ingress's answers and the HTTP proxy's,
    proxy_middleware.py)."""
    error = {
        "message": message,
        "type": ERROR_TYPES.get(status, "server_error"),
        "param": param,
        "code": code,
    }
    return {"error": error}


def error_response(error: OpenAIError) -> JSONResponse:
    body = error_body(error.status, error.message, error.param, error.code)
    headers = {"Retry-After": str(error.retry_after_s)} if error.retry_after_s else {}
    if error.refusing_for_s > 0:
        headers[REFUSING_FOR_HEADER] = str(round(error.refusing_for_s * 1e3))
    return JSONResponse(body, status_code=error.status, headers=headers or None)
