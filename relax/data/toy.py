"""The arithmetic toy task: prompts `a+b=` with small digits, labelled with the exact sum.

A 0.3 M-parameter Qwen2 learns it on CPU in seconds with GRPO and an exact-match reward, which makes it
the smoke test of the whole training loop. Rows look like
`{"prompt": "3+4=", "label": "7", "metadata": {"task": "arith"}}`.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FORMATS = ("jsonl", "parquet")


def arith_rows(
    n: int = 1000, max_digit: int = 4, seed: int = 0, messages: bool = False
) -> list[dict[str, Any]]:
    """`n` rows with a and b uniform in 0..max_digit; the prompt is `a+b=` (or one user message of it)."""
    if n < 1 or max_digit < 0:
        raise ValueError(f"need n >= 1 and max_digit >= 0, got n={n}, max_digit={max_digit}")
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, max_digit), rng.randint(0, max_digit)
        prompt = f"{a}+{b}="
        row: dict[str, Any] = (
            {"messages": [{"role": "user", "content": prompt}]} if messages else {"prompt": prompt}
        )
        row.update(label=str(a + b), metadata={"task": "arith"})
        rows.append(row)
    return rows


def generate_arith(
    out_path: str | Path,
    n: int = 1000,
    max_digit: int = 4,
    seed: int = 0,
    fmt: str | None = None,
    messages: bool = False,
) -> Path:
    """Write `n` arithmetic rows to `out_path` and return it.

    `fmt` is "jsonl" or "parquet"; by default it follows the file's extension (jsonl if it has none).
    With `messages=True` rows carry `messages` (one user turn) instead of `prompt`.
    """
    out = Path(out_path)
    fmt = fmt or (out.suffix.lstrip(".") if out.suffix.lstrip(".") in FORMATS else "jsonl")
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if out.suffix.lstrip(".") in FORMATS and out.suffix.lstrip(".") != fmt:
        raise ValueError(f"{out} has extension {out.suffix!r} but fmt={fmt!r}; make them agree")
    rows = arith_rows(n, max_digit, seed, messages)
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "jsonl":
        with out.open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), out)
    logger.info("wrote %d arithmetic rows (digits 0..%d) to %s", n, max_digit, out)
    return out
