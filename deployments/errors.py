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


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s


def error_response(error: OpenAIError) -> JSONResponse:
    body = {
        "error": {
            "message": error.message,
            "type": ERROR_TYPES.get(error.status, "server_error"),
            "param": error.param,
            "code": error.code,
        }
    }
    headers = {"Retry-After": str(error.retry_after_s)} if error.retry_after_s else None
    return JSONResponse(body, status_code=error.status, headers=headers)
