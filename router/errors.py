"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}`.

Every error the router answers has this shape and a 4xx/5xx status; none carries a
stack trace, a key or a config value.
"""

from __future__ import annotations

import json

from starlette.responses import Response

TYPE_OF_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
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

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> Response:
        return Response(
            self.body(), self.status, headers=self.headers, media_type="application/json"
        )


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> bytes:
    kind = TYPE_OF_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return json.dumps(
        {"error": {"message": message, "type": kind, "param": param, "code": code}}
    ).encode()
