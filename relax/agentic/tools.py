"""Tools a model can call: a name, a JSON schema of the arguments, and a function.

`Tool(name, description, parameters, fn)`: `fn(**arguments)` may be sync (it runs in a worker thread)
or async; it returns a string, a JSON-serialisable value, or a `ToolOutput` (text plus images, for tools
that show the model a picture). `call_tool` never raises: an unknown tool, arguments that do not match
the schema, an exception in the tool or a call running past its timeout all become an error result that
is shown to the model as the observation, so one bad call never crashes a rollout.

A sync tool that times out keeps running in its thread until it returns (Python threads cannot be
killed); give long-running tools an async implementation or their own internal timeout.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jsonschema

logger = logging.getLogger(__name__)


@dataclass
class ToolOutput:
    """What a tool returns when it has more than text: images travel to the next turn of a VLM."""

    text: str
    images: list[Any] = field(default_factory=list)  # PIL images, file paths or base64 data


@dataclass
class ToolResult:
    """The outcome of one call, as the environment reports it."""

    name: str
    text: str  # what the model sees
    ok: bool  # False: unknown tool, bad arguments, exception or timeout
    error: str = ""  # "unknown_tool" | "bad_arguments" | "exception" | "timeout" | ""
    images: list[Any] = field(default_factory=list)
    latency_s: float = 0.0


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object
    fn: Callable[..., Any]

    def schema(self) -> dict[str, Any]:
        """The OpenAI / Qwen function description listed in the system turn."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except TypeError:
        return str(value)


async def call_tool(tools: dict[str, Tool], name: str, arguments: Any, timeout_s: float) -> ToolResult:
    """Run one tool call with a timeout; every failure comes back as an error `ToolResult`."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    tool = tools.get(name)
    if tool is None:
        valid = ", ".join(sorted(tools)) or "none"
        return ToolResult(
            name, f"Error: unknown tool {name!r}; available tools: {valid}", False, "unknown_tool"
        )
    if not isinstance(arguments, dict):
        return ToolResult(name, "Error: arguments must be a JSON object", False, "bad_arguments")
    try:
        jsonschema.validate(arguments, tool.parameters)
    except jsonschema.ValidationError as e:
        return ToolResult(name, f"Error: bad arguments for {name}: {e.message}", False, "bad_arguments")
    try:
        if inspect.iscoroutinefunction(tool.fn):
            value = await asyncio.wait_for(tool.fn(**arguments), timeout_s)
        else:
            value = await asyncio.wait_for(asyncio.to_thread(tool.fn, **arguments), timeout_s)
    except asyncio.TimeoutError:
        return ToolResult(
            name, f"Error: {name} timed out after {timeout_s:g}s", False, "timeout", latency_s=timeout_s
        )
    except Exception as e:  # noqa: BLE001 - a tool's failure is an observation, not a crash
        logger.debug("tool %s failed on %r", name, arguments, exc_info=e)
        return ToolResult(
            name, f"Error: {type(e).__name__}: {e}", False, "exception", latency_s=loop.time() - start
        )
    latency = loop.time() - start
    if isinstance(value, ToolOutput):
        return ToolResult(name, value.text, True, images=list(value.images), latency_s=latency)
    return ToolResult(name, _as_text(value), True, latency_s=latency)
