"""Every failure the server reports is an OpenAI error body with an HTTP status:
``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations


class APIError(Exception):
    """A failure to report to the client as it is (status, one-line message, the field
    it concerns, OpenAI's error code)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("server_error" if status >= 500 else ERROR_TYPES.get(status, "invalid_request_error"))

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


# OpenAI's `type` for the statuses the server uses.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
}


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid(param: str, message: str, code: str = "invalid_value") -> APIError:
    """A 400 for one field of the request."""
    return APIError(400, message, param=param, code=code)


def internal_error(message: str = "internal server error: see the server log") -> APIError:
    return APIError(500, message, code="internal_error")
