"""A two-agent program: a planner writes a plan, a worker follows it in its own conversation (two calls).
The two conversations share no history, so Relax sees two contexts of one sample."""

from __future__ import annotations

import json
import os

from openai import OpenAI


def main() -> None:
    client = OpenAI(base_url=os.environ["RELAX_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"])
    task = json.load(open(os.environ["RELAX_SAMPLE_FILE"]))["prompt"]
    plan = (
        client.chat.completions.create(
            model="policy",
            messages=[{"role": "system", "content": "You plan."}, {"role": "user", "content": task}],
            max_tokens=5,
        )
        .choices[0]
        .message.content
    )
    worker = [{"role": "system", "content": "You work."}, {"role": "user", "content": f"{task} Plan: {plan}"}]
    first = client.chat.completions.create(model="policy", messages=worker, max_tokens=5).choices[0].message
    worker += [first.model_dump(exclude_none=True), {"role": "user", "content": "Check it."}]
    client.chat.completions.create(model="policy", messages=worker, max_tokens=5)


if __name__ == "__main__":
    main()
