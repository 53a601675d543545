"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status,
and the headers some of them need (``Retry-After`` on 429). Every refusal of the server is an
``APIError``; the app turns it, and FastAPI's own errors (unknown route, wrong method), into this body.
"""
from __future__ import annotations

import json

# OpenAI's error types by status (its API's own, where it has one).
ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    """A request refused or ended with ``status``; ``param`` names the request field at fault."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def json(self) -> bytes:
        return json.dumps(self.body(), separators=(",", ":")).encode()


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def unavailable(message: str, code: str) -> APIError:
    return APIError(503, message, code=code)
