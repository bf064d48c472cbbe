"""An agent program written against the `openai` client, as a user would write one: three calls that
continue one conversation (one of them streamed), then an edited history (a new branch).
It prints, as JSON, what the server answered to each call, for the test to compare."""

from __future__ import annotations

import json
import os
import sys

from openai import OpenAI

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expr": {"type": "string"}},
                "required": ["expr"],
            },
        },
    }
]


def main() -> None:
    client = OpenAI(base_url=os.environ["RELAX_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"])
    sample = json.load(open(os.environ["RELAX_SAMPLE_FILE"]))
    branch = "--branch" in sys.argv
    # Seeded calls: the replies are the same whatever order the sessions' requests reach the engine in
    # (unseeded ones draw from one stream in arrival order, which a loaded machine reorders).
    seed = sum(map(ord, sample["prompt"]))
    messages = [{"role": "user", "content": sample["prompt"]}]
    seen = []
    for step in range(3):
        if step == 1:  # streamed: the chunks add up to the message
            stream = client.chat.completions.create(
                model="policy", messages=messages, tools=TOOLS, max_tokens=6, stream=True, seed=seed + step
            )
            content = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            reply = {"role": "assistant", "content": content}
        else:
            resp = client.chat.completions.create(
                model="policy", messages=messages, tools=TOOLS, max_tokens=6, seed=seed + step
            )
            reply = resp.choices[0].message.model_dump(exclude_none=True)
        seen.append(reply)
        messages += [reply, {"role": "user", "content": f"Step {step} done. Go on."}]
    if branch:  # the agent rewrites its history: drop the middle exchange
        edited = messages[:2] + messages[4:]
        resp = client.chat.completions.create(
            model="policy", messages=edited, tools=TOOLS, max_tokens=6, seed=seed + 3
        )
        seen.append(resp.choices[0].message.model_dump(exclude_none=True))
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
