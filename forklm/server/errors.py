"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error the server answers with (never a stack trace)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def param_of_message(message: str) -> str | None:
    """forklm's argument errors start with the argument's name ("top_p must be ...")."""
    head = message.split(" ", 1)[0].rstrip(":")
    return head if head.replace("_", "").isalnum() and head.islower() else None
