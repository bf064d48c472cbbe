"""The calculator-tool task: `a*b` with a two-digit `a`, which a tiny model cannot multiply by itself but
can solve by calling the tool and copying its result.

An episode of two turns (compact call form, see `relax.agentic.parser`)::

    37*8=<tool_call>37*8</tool_call>                                      model (loss mask 1)
    <|im_end|>\\n<|im_start|>user\\n<tool_response>\\n296\\n</tool_response><|im_end|>\\n
    <|im_start|>assistant\\n                                                 environment (mask 0)
    296<|im_end|>                                                          model

JSON calls (`<tool_call>{"name": "calc", "arguments": {"expr": "37*8"}}</tool_call>`) work the same.
The reward (`calc_reward`) is 1 for a correct final answer, and else a shaped format credit that lets a
model trained from random initialisation discover the tool, one step at a time: 0.1 for opening a tool
call, 0.1 more when it is well formed (closed, parsed), 0.1 more when it runs, 0.2 more when its result
is the answer. Data: `relax data calc`.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from pathlib import Path
from typing import Any

from relax.agentic.env import ToolEnv
from relax.agentic.tools import Tool
from relax.data.sample import Sample

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_MAX_ABS = 10**12  # results beyond this are refused (no 9**9**9)


def evaluate(expr: str) -> int | float:
    """Value of an arithmetic expression of numbers, + - * / // % and parentheses; ValueError otherwise."""

    def ev(node: ast.AST) -> int | float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, (int, float))
            and not isinstance(node.value, bool)
        ):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            v = _OPS[type(node.op)](ev(node.left), ev(node.right))
            if abs(v) > _MAX_ABS:
                raise ValueError("result too large")
            return v
        raise ValueError(f"unsupported expression element {type(node).__name__}")

    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expr!r}") from None
    try:
        value = ev(tree)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    return int(value) if isinstance(value, float) and value.is_integer() else value


def calc(expr: str) -> str:
    return str(evaluate(expr))


CALC_TOOL = Tool(
    name="calc",
    description="Evaluate an arithmetic expression (numbers, + - * / // % and parentheses).",
    parameters={
        "type": "object",
        "properties": {"expr": {"type": "string", "description": "the expression, e.g. 37*8"}},
        "required": ["expr"],
    },
    fn=calc,
)


def make_env(timeout_s: float = 10.0, compact: bool = True) -> ToolEnv:
    """The calculator environment (`rollout.agent.env: calculator`)."""
    return ToolEnv([CALC_TOOL], timeout_s=timeout_s, compact_tool=("calc", "expr") if compact else None)


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def final_answer(sample: Sample) -> str | None:
    """The first number of the last model turn's text outside tool calls (or of the response)."""
    from relax.agentic.parser import parse_tool_calls

    text = sample.turns[-1]["text"] if sample.turns else sample.response_text
    m = _NUMBER.search(parse_tool_calls(text).content)
    return m.group(0) if m else None


def calc_reward(sample: Sample, **_: Any) -> dict[str, float]:
    """1 for the right final answer; else 0.1 (a call opened) + 0.1 (well formed) + 0.1 (it ran) + 0.2 (its
    result is the answer)."""
    label = str(sample.label).strip()
    calls = [c for t in sample.turns for c in t.get("tool_calls", [])]
    results = [r for t in sample.turns for r in t.get("results", [])]
    opened = bool(calls) or "<tool_call>" in sample.response_text
    formed = any(not c.get("error") for c in calls)
    ran = any(r["ok"] for r in results)
    right_value = any(r["ok"] and r["text"].strip() == label for r in results)
    answer = final_answer(sample)
    correct = answer is not None and answer == label
    shaped = 0.1 * opened + 0.1 * formed + 0.1 * ran + 0.2 * right_value
    return {
        "reward": 1.0 if correct else shaped,
        "answer_correct": float(correct),
        "tool_opened": float(opened),
        "tool_well_formed": float(formed),
        "tool_ran": float(ran),
        "tool_right_value": float(right_value),
    }


def calc_rows(
    n: int = 1000,
    seed: int = 0,
    a_range: tuple[int, int] = (10, 99),
    b_range: tuple[int, int] = (2, 9),
    messages: bool = False,
) -> list[dict[str, Any]]:
    """`n` rows `a*b=`. `messages=True`: a chat prompt that shows the JSON tool call by an example."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(*a_range), rng.randint(*b_range)
        expr = f"{a}*{b}"
        prompt: Any = f"{expr}="
        if messages:
            example = '<tool_call>\n{"name": "calc", "arguments": {"expr": "12*3"}}\n</tool_call>'
            prompt = [
                {"role": "system", "content": f"Use the calc tool for arithmetic. Example: {example}"},
                {"role": "user", "content": f"What is {expr}? Answer with the number only."},
            ]
        row = {"messages": prompt} if messages else {"prompt": prompt}
        row.update(label=str(a * b), metadata={"task": "calc", "expr": expr})
        rows.append(row)
    return rows


def generate_calc(out_path: str | Path, n: int = 1000, seed: int = 0, messages: bool = False) -> Path:
    """Write `n` calculator rows to a .jsonl file."""
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for row in calc_rows(n, seed, messages=messages):
            f.write(json.dumps(row) + "\n")
    return out
