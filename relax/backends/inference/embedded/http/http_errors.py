"""Error answers of the engine's native (SGLang) routes: 400 with `{"error": {"message": ...}}` naming the
problem (SGLang's shape). The OpenAI routes answer in OpenAI's shape (`relax.engine_api.openai`)."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


def bad_request(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def validation_message(errors: list[dict[str, Any]]) -> str:
    """Pydantic's errors as one line: `field.path: message; ...`."""
    parts = []
    for e in errors:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        msg = str(e.get("msg")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)
