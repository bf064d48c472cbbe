"""OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}` with the HTTP status."""

from __future__ import annotations

from fastapi.responses import JSONResponse

TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    503: "service_unavailable",
    500: "server_error",
}


class OpenAIError(Exception):
    """Raised anywhere under a route; answered in OpenAI's shape."""

    def __init__(
        self, message: str, status: int = 400, param: str | None = None, code: str | None = None
    ) -> None:
        """`code`: OpenAI's error code where it has one (`model_not_found`); else the HTTP status."""
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code


def openai_error(
    message: str, status: int = 400, param: str | None = None, code: str | None = None
) -> JSONResponse:
    body = {"message": message, "type": TYPES.get(status, "invalid_request_error"), "param": param,
            "code": code or status}  # fmt: skip
    return JSONResponse({"error": body}, status_code=status)
