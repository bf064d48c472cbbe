"""Environments used by the agentic tests (importable by path, like a user's own)."""

from __future__ import annotations

import asyncio
import threading

from relax.agentic.env import Message, ModelTurn, StepResult, ToolEnv
from relax.agentic.parser import ToolCall
from relax.agentic.tools import Tool


class EchoEnv:
    """Answers every turn with a user message naming the turn; never ends the episode by itself."""

    tools: list = []

    def __init__(self, timeout_s: float = 1.0, reply: str = "turn {i} seen") -> None:
        self.reply = reply
        self.closed = False

    async def reset(self, sample):
        return []

    async def step(self, turn: ModelTurn) -> StepResult:
        return StepResult([Message("user", self.reply.format(i=turn.index))], done=False)

    async def close(self) -> None:
        self.closed = True


def make_echo(**kw) -> EchoEnv:
    return EchoEnv(**kw)


async def _hang(x: str) -> str:
    await asyncio.sleep(30.0)
    return x


def _boom(x: str) -> str:
    raise RuntimeError("the tool broke")


class ForcedToolEnv(ToolEnv):
    """Calls the tool named `tool` after every model turn, whatever the model wrote: drives the tool
    paths with a random model, which does not write tool calls by itself."""

    def __init__(self, tool: str = "boom", timeout_s: float = 0.3) -> None:
        schema = {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}
        # the sync tool's thread blocks until the episode ends (or 30 s pass): past any timeout however
        # busy the machine, and not a moment longer (asyncio.run waits for it on the way out)
        self._released = threading.Event()

        def _slow(x: str) -> str:
            self._released.wait(30.0)
            return x

        tools = [
            Tool("slow", "sleeps", schema, _slow),
            Tool("hang", "hangs", schema, _hang),
            Tool("boom", "raises", schema, _boom),
        ]
        super().__init__(tools, timeout_s=timeout_s)
        self.tool = tool

    async def step(self, turn: ModelTurn) -> StepResult:
        results = await self.run_calls([ToolCall(self.tool, {"x": "hi"})])
        return StepResult([Message("tool", r.text) for r in results], tool_results=results)

    async def close(self) -> None:
        self._released.set()
        await super().close()


def make_forced(**kw) -> ForcedToolEnv:
    return ForcedToolEnv(**kw)


class ImageToolEnv:
    """A tool that shows a picture: every turn is answered with a tool message carrying one image."""

    tools: list = []

    def __init__(self, timeout_s: float = 1.0, colours: tuple[str, ...] = ("red", "blue")) -> None:
        self.colours = colours

    async def reset(self, sample):
        return []

    async def step(self, turn: ModelTurn) -> StepResult:
        from PIL import Image

        img = Image.new("RGB", (56, 56), self.colours[turn.index % len(self.colours)])
        return StepResult([Message("tool", "Here is the picture:", images=[img])])

    async def close(self) -> None:
        return None


def make_image_tool(**kw) -> ImageToolEnv:
    return ImageToolEnv(**kw)
