"""OpenAI-style error objects: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

from aiohttp import web


class ApiError(Exception):
    """Raised anywhere in a request; the app turns it into the OpenAI error object."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             408: "invalid_request_error", 413: "invalid_request_error", 431: "invalid_request_error", 429: "rate_limit_exceeded", 502: "upstream_error",
             503: "service_unavailable", 504: "timeout"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "api_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)


class UpstreamFailed(Exception):
    """An engine errored (5xx), timed out or was unreachable: worth trying another one."""

    def __init__(self, url: str, why: str) -> None:
        super().__init__(f"{url}: {why}")
        self.url = url
