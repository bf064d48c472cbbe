"""A search task in the spirit of Search-R1, against a small local document index (no network).

A synthetic world of made-up countries, each with a capital, a river and a colour, written as short
documents; a question asks for one fact ("What is the capital of Zorbia?"), which the model cannot know
without searching. The tool `search(query)` returns the best `k` documents by BM25 (PyPI `bm25s`).
Compact calls (`<tool_call>capital of Zorbia</tool_call>`) and JSON calls both work.

`relax data search --out prompts.jsonl` writes the prompts and, beside them, `<name>_docs.jsonl` (one
`{"id", "text"}` per line); configure `rollout.agent.env: search` with `env_kwargs: {index: DOCS}`.
The reward (`search_reward`) is 1 when the final answer names the right fact, else a format credit:
0.1 for a call, 0.1 more when it ran, 0.3 more when a returned document holds the answer.
"""

from __future__ import annotations

import functools
import json
import random
import re
from pathlib import Path
from typing import Any

from relax.agentic.env import ToolEnv
from relax.agentic.tools import Tool
from relax.data.sample import Sample

_SYLLABLES = "ka lo mi ra zu ten vor qua bel dri mon sha tul nex pim gor ly fen".split()
_COLOURS = "red green blue yellow purple orange white black".split()
FACTS = ("capital", "river", "colour")


def _name(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(parts)).capitalize()


def world(n_countries: int = 50, seed: int = 0) -> list[dict[str, str]]:
    """`n_countries` made-up countries with distinct names and their facts."""
    rng = random.Random(seed)
    names: set[str] = set()
    out = []
    while len(out) < n_countries:
        name = _name(rng, 3)
        if name in names:
            continue
        names.add(name)
        out.append(
            {
                "country": name,
                "capital": _name(rng, 2),
                "river": _name(rng, 2),
                "colour": rng.choice(_COLOURS),
            }
        )
    return out


def documents(countries: list[dict[str, str]]) -> list[dict[str, str]]:
    docs = []
    for c in countries:
        n = c["country"]
        docs.append({"id": f"{n}-capital", "text": f"The capital of {n} is {c['capital']}."})
        docs.append({"id": f"{n}-river", "text": f"The longest river of {n} is the {c['river']}."})
        docs.append({"id": f"{n}-colour", "text": f"The flag of {n} is {c['colour']}."})
    return docs


class DocumentIndex:
    """BM25 over a list of `{"id", "text"}` documents."""

    def __init__(self, docs: list[dict[str, str]]) -> None:
        import bm25s

        if not docs:
            raise ValueError("the document index is empty")
        self.docs = docs
        self._bm25s = bm25s
        self.retriever = bm25s.BM25()
        self.retriever.index(
            bm25s.tokenize([d["text"] for d in docs], show_progress=False), show_progress=False
        )

    def search(self, query: str, k: int = 2) -> list[dict[str, str]]:
        tokens = self._bm25s.tokenize([query], show_progress=False)
        if not tokens.vocab:
            return []
        ids, scores = self.retriever.retrieve(tokens, k=min(k, len(self.docs)), show_progress=False)
        return [self.docs[int(i)] for i, s in zip(ids[0], scores[0], strict=True) if s > 0]


@functools.lru_cache(maxsize=8)
def load_index(path: str) -> DocumentIndex:
    """The index of a `{"id", "text"}` JSONL file (built once per process)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(
            f"search index {p} not found; write one with `relax data search --out PROMPTS.jsonl` "
            "and set rollout.agent.env_kwargs.index to its _docs.jsonl file"
        )
    return DocumentIndex(
        [json.loads(line) for line in p.read_text(encoding="utf-8-sig").splitlines() if line.strip()]
    )


def make_env(index: str, timeout_s: float = 10.0, k: int = 2, compact: bool = True) -> ToolEnv:
    """The search environment (`rollout.agent.env: search`, `env_kwargs: {index: DOCS.jsonl}`)."""
    idx = load_index(str(index))

    def search(query: str) -> str:
        hits = idx.search(query, k)
        return "\n".join(d["text"] for d in hits) if hits else "No results."

    tool = Tool(
        name="search",
        description="Search the encyclopedia; returns the best matching documents.",
        parameters={"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        fn=search,
    )
    return ToolEnv([tool], timeout_s=timeout_s, compact_tool=("search", "query") if compact else None)


def search_reward(sample: Sample, **_: Any) -> dict[str, float]:
    """1 when the last turn's answer starts with the label; else the format credit."""
    from relax.agentic.parser import parse_tool_calls

    label = str(sample.label).strip().lower()
    calls = [c for t in sample.turns for c in t.get("tool_calls", [])]
    results = [r for t in sample.turns for r in t.get("results", [])]
    text = sample.turns[-1]["text"] if sample.turns else sample.response_text
    words = re.findall(r"[a-z0-9]+", parse_tool_calls(text).content.lower())
    correct = bool(words) and words[0] == label
    found = any(r["ok"] and label in r["text"].lower() for r in results)
    ran = any(r["ok"] for r in results)
    shaped = 0.1 * bool(calls) + 0.1 * ran + 0.3 * found
    return {
        "reward": 1.0 if correct else shaped,
        "answer_correct": float(correct),
        "tool_found_answer": float(found),
    }


def generate_search(
    out_path: str | Path, n: int = 1000, seed: int = 0, n_countries: int = 50, messages: bool = False
) -> tuple[Path, Path]:
    """Write `n` questions to `out_path` and the documents to `<stem>_docs.jsonl` beside it."""
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    countries = world(n_countries, seed)
    docs_path = out.with_name(f"{out.stem}_docs.jsonl")
    docs_path.write_text("".join(json.dumps(d) + "\n" for d in documents(countries)))
    rng = random.Random(seed + 1)
    questions = {
        "capital": "What is the capital of {n}?",
        "river": "What is the longest river of {n}?",
        "colour": "What colour is the flag of {n}?",
    }
    with out.open("w", encoding="utf-8") as f:
        for _ in range(n):
            c, fact = rng.choice(countries), rng.choice(FACTS)
            q = questions[fact].format(n=c["country"])
            prompt: Any = q
            if messages:
                example = '<tool_call>\n{"name": "search", "arguments": {"query": "capital of Kalomi"}}\n</tool_call>'
                prompt = [
                    {"role": "system", "content": f"Search before answering. Example: {example}"},
                    {"role": "user", "content": f"{q} Answer with one word."},
                ]
            row = {"messages": prompt} if messages else {"prompt": prompt}
            row.update(label=c[fact], metadata={"task": "search", "fact": fact, "country": c["country"]})
            f.write(json.dumps(row) + "\n")
    return out, docs_path
