"""The environment interface of multi-turn rollouts, and the tool-calling environment.

An environment sees one sample's episode::

    obs = await env.reset(sample)          # messages to append before the first turn (usually none)
    while True:
        result = await env.step(turn)      # the model's turn (text, parsed tool calls, tokens)
        if result.done: break              # else result.observation is appended as environment turns
    await env.close()

Observations are chat messages (`{"role": "tool" | "user", "content": str}`), optionally with images
(`Message.images`) that a VLM sees in the next turn. The rollout turns them into tokens with the chat
template (`relax.agentic.turns`) and gives them loss mask 0.

To add an environment: write a class with these three methods (and `tools` if it has any) and either
register a factory in `ENVIRONMENTS` or configure it by import path, `rollout.agent.env:
package.module:factory` (called with `rollout.agent.env_kwargs`; a new instance per episode).
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from relax.agentic.parser import ParsedTurn, ToolCall
from relax.agentic.tools import Tool, ToolResult, call_tool
from relax.data.sample import Sample


@dataclass
class Message:
    """One environment turn: a chat message plus the images it shows."""

    role: str  # "tool" (a tool's result) or "user"
    content: str
    images: list[Any] = field(default_factory=list)  # PIL images / paths / base64 (VLMs)


@dataclass
class ModelTurn:
    """What the model produced in one turn."""

    text: str  # decoded turn (special tokens kept)
    token_ids: list[int]
    parsed: ParsedTurn
    finish_reason: str  # "stop" | "length"
    index: int  # 0-based turn number

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.parsed.tool_calls


@dataclass
class StepResult:
    observation: list[Message] = field(default_factory=list)  # appended when not done
    done: bool = False  # the episode is over (e.g. the model answered without calling a tool)
    info: dict[str, Any] = field(default_factory=dict)  # recorded in the sample's trace
    tool_results: list[ToolResult] = field(default_factory=list)


class Environment(Protocol):
    tools: list[Tool]

    async def reset(self, sample: Sample) -> list[Message]: ...

    async def step(self, turn: ModelTurn) -> StepResult: ...

    async def close(self) -> None: ...


class ToolEnv:
    """Runs the turn's tool calls and shows their results; the episode ends at a turn without calls.

    `compact_tool=(name, arg)` accepts `<tool_call>text</tool_call>` as `name(arg=text)`
    (`relax.agentic.parser`). Calls of one turn run concurrently, each under `timeout_s`.
    """

    def __init__(
        self, tools: list[Tool], *, timeout_s: float = 10.0, compact_tool: tuple[str, str] | None = None
    ) -> None:
        self.tools = list(tools)
        self.by_name = {t.name: t for t in self.tools}
        self.timeout_s = timeout_s
        self.compact_tool = compact_tool
        self.sample: Sample | None = None

    async def reset(self, sample: Sample) -> list[Message]:
        self.sample = sample
        return []

    async def run_calls(self, calls: list[ToolCall]) -> list[ToolResult]:
        async def one(call: ToolCall) -> ToolResult:
            if not call.ok:
                return ToolResult(call.name, f"Error: {call.error}", False, "parse_error")
            return await call_tool(self.by_name, call.name, call.arguments, self.timeout_s)

        return list(await asyncio.gather(*(one(c) for c in calls)))

    async def step(self, turn: ModelTurn) -> StepResult:
        if not turn.tool_calls:
            return StepResult(done=True)
        results = await self.run_calls(turn.tool_calls)
        obs = [Message("tool", r.text, list(r.images)) for r in results]
        return StepResult(obs, done=False, tool_results=results)

    async def close(self) -> None:
        return None


def _builtin(name: str) -> Callable[..., Environment]:
    if name == "tools":
        return lambda **kw: ToolEnv(list(kw.pop("tools", [])), **kw)
    if name == "calculator":
        from relax.agentic.tasks.calculator import make_env

        return make_env
    if name == "search":
        from relax.agentic.tasks.search import make_env

        return make_env
    raise KeyError(name)


ENVIRONMENTS = ("tools", "calculator", "search")  # built-in names (see _builtin)


def env_factory(spec: str) -> Callable[..., Environment]:
    """The factory named by a built-in name or an import path `package.module:factory`."""
    if ":" not in spec:
        try:
            return _builtin(spec)
        except KeyError:
            raise ValueError(
                f"unknown environment {spec!r}; built-ins: {', '.join(ENVIRONMENTS)}, "
                "or give an import path package.module:factory"
            ) from None
    module, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import environment factory {spec!r}: {e}") from e
    if not callable(fn):
        raise ValueError(f"environment factory {spec!r} is not callable")
    return fn
