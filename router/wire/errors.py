"""Error bodies in the client's API shape, and the exception that carries one.

OpenAI endpoints answer `{"error": {"message", "type", "param", "code"}}`; the Anthropic
Messages endpoint answers `{"type": "error", "error": {"type", "message"}}` (what the
Anthropic SDK parses into its typed errors, and what SGLang's `/v1/messages` sends), and
inside a stream an `event: error` with that body. Every error the router answers has a
4xx/5xx status and one of these shapes; none carries a stack trace, a key or a config value.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import Response

TYPE_OF_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}
# Anthropic's error types (as SGLang 0.5.17's /v1/messages maps statuses to them).
ANTHROPIC_TYPE_OF_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "request_timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class ApiError(Exception):
    """An error to answer as-is (raised anywhere in a request, turned into a response)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def __reduce__(self) -> tuple[Any, ...]:
        """Picklable with all its fields (request bodies may be parsed in a worker process)."""
        return ApiError, (self.status, self.message, self.param, self.code, self.headers)

    def body(self, anthropic: bool = False) -> bytes:
        if anthropic:
            return anthropic_error_body(self.status, self.message)
        return error_body(self.status, self.message, self.param, self.code)

    def response(self, anthropic: bool = False) -> Response:
        return Response(
            self.body(anthropic), self.status, headers=self.headers, media_type="application/json"
        )

    def sse(self, anthropic: bool) -> bytes:
        """The error as the last event of a stream whose status line is already sent."""
        if anthropic:
            return b"event: error\ndata: " + self.body(anthropic=True) + b"\n\n"
        return b"data: " + self.body() + b"\n\n"


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> bytes:
    kind = TYPE_OF_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return json.dumps(
        {"error": {"message": message, "type": kind, "param": param, "code": code}}
    ).encode()


def anthropic_error_body(status: int, message: str) -> bytes:
    kind = ANTHROPIC_TYPE_OF_STATUS.get(
        status, "api_error" if status >= 500 else "invalid_request_error"
    )
    return json.dumps({"type": "error", "error": {"type": kind, "message": message}}).encode()
