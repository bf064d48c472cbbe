"""Trajectories rebuilt from the chat calls an agent made, token for token.

Every call of a session is recorded with the exact prompt tokens the engine saw, the tokens it generated
and their behaviour log-probs. A call whose messages start with an earlier call's messages plus that
call's reply *extends* it: its prompt is built as the earlier call's tokens + its output tokens + the new
messages' tokens (`ChatSession`), so one growing token sequence holds the whole conversation and no
model token is ever re-tokenized. The parent of a call is the earlier call with the longest such match.

When an agent rewrites its history (drops or edits a message, changes the tools, starts another role's
conversation), no earlier call matches: the call starts a new root, and the session has several
branches. `build_trajectories` returns one `Trajectory` per leaf call (root-to-leaf chain): the tokens
before the root's output are the prompt, the rest is the response, with loss mask 1 and log-probs on
each call's output and 0 on the messages between.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


def _args(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def normalize_message(m: dict[str, Any]) -> tuple:
    """What identifies a message for prefix matching: role, text and tool calls (name, arguments);
    call ids and formatting of the arguments JSON do not matter."""
    content = m.get("content")
    if isinstance(content, list):  # OpenAI content parts
        content = "".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    calls = []
    for c in m.get("tool_calls") or []:
        fn = c.get("function", c)
        calls.append((fn.get("name"), json.dumps(_args(fn.get("arguments")), sort_keys=True)))
    return (m.get("role"), (content or "").strip(), tuple(calls))


@dataclass
class CallRecord:
    """One chat call: what it was asked and what the engine produced."""

    index: int  # order within the session
    messages: list[tuple]  # normalized request messages
    tools_key: str  # JSON of the tools (a call with other tools cannot extend this one)
    reply: tuple  # normalized assistant reply
    prompt_ids: list[int]  # exact tokens the engine saw
    output_ids: list[int]  # generated tokens
    log_probs: list[float]  # behaviour log-probs, one per output token
    weight_version: int
    finish_reason: str
    parent: int | None  # index of the call it extends (None = a root)
    reply_message: dict[str, Any] = field(default_factory=dict)  # the reply as sent (OpenAI shape)


@dataclass
class Trajectory:
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    rollout_log_probs: list[float]
    weight_versions: list[int]
    calls: list[int]  # indexes of the calls on this branch, root first
    finish_reason: str  # of the last call


class SessionRecorder:
    def __init__(self) -> None:
        self.calls: list[CallRecord] = []

    def find_parent(self, messages: list[tuple], tools_key: str) -> CallRecord | None:
        """The earlier call whose messages + reply are the longest prefix of `messages`."""
        best: CallRecord | None = None
        for rec in self.calls:
            k = len(rec.messages)
            if rec.tools_key != tools_key or len(messages) <= k:
                continue
            if messages[:k] == rec.messages and messages[k] == rec.reply:
                if best is None or k > len(best.messages):
                    best = rec
        return best

    def add(self, rec: CallRecord) -> None:
        self.calls.append(rec)

    def build_trajectories(self) -> list[Trajectory]:
        """One trajectory per leaf call, in the order the leaves were made."""
        extended = {c.parent for c in self.calls if c.parent is not None}
        out = []
        for leaf in self.calls:
            if leaf.index in extended:
                continue
            chain = [leaf]
            while chain[-1].parent is not None:
                chain.append(self.calls[chain[-1].parent])
            chain.reverse()
            root = chain[0]
            p = len(root.prompt_ids)
            tokens = leaf.prompt_ids + leaf.output_ids
            mask = [0] * (len(tokens) - p)
            lps = [0.0] * (len(tokens) - p)
            for rec in chain:
                s = len(rec.prompt_ids) - p
                if tokens[p + s : p + s + len(rec.output_ids)] != rec.output_ids:
                    raise RuntimeError(f"call {rec.index} is not a token prefix of call {leaf.index}")
                mask[s : s + len(rec.output_ids)] = [1] * len(rec.output_ids)
                lps[s : s + len(rec.output_ids)] = rec.log_probs
            versions: list[int] = []
            for rec in chain:
                if not versions or versions[-1] != rec.weight_version:
                    versions.append(rec.weight_version)
            out.append(
                Trajectory(
                    prompt_ids=list(root.prompt_ids),
                    response_ids=tokens[p:],
                    loss_mask=mask,
                    rollout_log_probs=lps,
                    weight_versions=versions,
                    calls=[c.index for c in chain],
                    finish_reason=leaf.finish_reason,
                )
            )
        return out
