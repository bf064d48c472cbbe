"""The ``remote`` reward: ask an HTTP reward service.

POSTs one JSON object per sample to ``url``::

    {"index": ..., "group_id": ..., "prompt": ..., "response": ..., "label": ..., "metadata": {...}}

and reads the answer: either a JSON number (the reward) or a JSON object whose ``reward`` entry is the
reward and whose other numeric entries are logged as metrics.
Values that JSON cannot carry (in ``label`` or ``metadata``) are sent as their ``str()``.

Any failure — connection refused, HTTP status >= 400, a timeout, an answer that is not JSON or has no
reward — raises, and the scorer gives the sample its fallback reward.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from relax.data.sample import Sample


def request_body(sample: Sample) -> dict[str, Any]:
    """The JSON object sent for one sample."""
    return {
        "index": sample.index,
        "group_id": sample.group_id,
        "prompt": sample.prompt,
        "response": sample.response_text,
        "label": sample.label,
        "metadata": sample.metadata,
    }


async def remote(
    sample: Sample,
    url: str,
    timeout_s: float = 30.0,
    headers: dict[str, str] | None = None,
) -> float | dict[str, Any]:
    """POST the sample to ``url`` (within ``timeout_s`` seconds) and return the service's reward."""
    content = json.dumps(request_body(sample), default=str)
    all_headers = {"content-type": "application/json", **(headers or {})}
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        response = await client.post(url, content=content, headers=all_headers)
        response.raise_for_status()
    answer = response.json()
    if isinstance(answer, bool) or not isinstance(answer, (int, float, dict)):
        raise ValueError(f"reward service {url} answered {answer!r}; expected a number or an object")
    return answer if isinstance(answer, dict) else float(answer)
