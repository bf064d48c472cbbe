"""`/generate`'s answers in SGLang's shape: one item per sample, `{"text", "output_ids", "meta_info"}`,
with the log-prob fields a request asked for (`[log-prob, token id, text | None]` triples; text only with
`return_text_in_logprobs`), finished or (streaming) so far; or, for a client that accepts it, the same
items packed (`relax.engine_api.packed`: MessagePack, the output ids and log-probs as raw arrays)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic_core import to_json

from relax.backends.inference.embedded.model.prompt_logprobs import PromptLogprobs
from relax.backends.inference.embedded.sampling.grammar import Grammar
from relax.backends.inference.embedded.scheduling.sequence import GenerationResult
from relax.engine_api import packed as packed_reply
from relax.engine_api.protocol import SamplingParams
from relax.utils.gc_freeze import collector_paused


@dataclass
class Job:
    """One prompt of a `/generate` request, validated and ready to submit."""

    prompt: list[int]
    params: SamplingParams
    rid: str
    return_logprob: bool
    logprob_start: int  # first prompt position whose log-prob is reported
    top_k: int  # top_logprobs_num
    media: dict[str, Any] | None
    grammar: Grammar | None
    prompt_logprobs: PromptLogprobs | None = None  # filled before submission when asked for


@dataclass
class Partial:
    """A streaming sample so far."""

    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[Any] = field(default_factory=list)
    emitted: int = 0  # tokens already reported in a chunk


def triples(pairs: list[tuple[float | None, int]], tokenizer: Any) -> list[list[Any]]:
    return [[lp, t, tokenizer.decode([t]) if tokenizer is not None else None] for lp, t in pairs]


def logprob_fields(
    job: Job, ids: list[int], lps: list[float], tops: list[Any], tokenizer: Any, packed: bool = False
) -> dict:
    """The meta_info log-prob fields of a sample (`tokenizer`: None unless return_text_in_logprobs;
    `packed`: the output log-probs as one float64 array, `relax.engine_api.packed`)."""
    if not job.return_logprob:
        return {}
    pl = job.prompt_logprobs
    if pl is None:  # the default start: the last prompt token only, which has no log-prob
        pl = PromptLogprobs([job.prompt[-1]], [None], [None] if job.top_k else [])
    out: dict[str, Any] = {
        "input_token_logprobs": triples(list(zip(pl.logprobs, pl.tokens, strict=True)), tokenizer)
    }
    if packed:
        out[packed_reply.LOGPROB_VALUES] = packed_reply.pack_logprobs(lps)
    else:
        out["output_token_logprobs"] = triples(list(zip(lps, ids, strict=True)), tokenizer)
    if job.top_k > 0:
        out["input_top_logprobs"] = [None if t is None else triples(t, tokenizer) for t in pl.top]
        out["output_top_logprobs"] = [triples(t or [], tokenizer) for t in tops]
    return out


def final_item(
    r: GenerationResult, job: Job, tokenizer: Any, text_in_logprobs: bool, packed: bool = False
) -> dict[str, Any]:
    """A finished sample's item; `packed`: its output ids and log-probs as raw arrays (never with
    `text_in_logprobs`, whose triples carry each token's text)."""
    meta: dict[str, Any] = {
        "id": r.rid,
        "finish_reason": r.finish_reason,
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": len(r.output_ids),
        "cached_tokens": 0,
        "weight_version": r.weight_version,
        "e2e_latency": r.e2e_latency,
    }
    if len(r.weight_versions) > 1:  # Relax's extension: the weights changed while the sample ran
        meta["weight_versions"] = r.weight_versions
        meta["weight_version_starts"] = r.weight_version_starts
    tok = tokenizer if text_in_logprobs else None
    meta.update(logprob_fields(job, r.output_ids, r.output_logprobs, r.output_top_logprobs, tok, packed))
    ids = packed_reply.pack_ids(r.output_ids) if packed else r.output_ids
    return {"text": r.text, "output_ids": ids, "meta_info": meta}


def reply_body(
    groups: list[list[GenerationResult]],
    jobs: list[Job],
    tokenizer: Any,
    text_in_logprobs: bool,
    batched: bool,
    packed: bool = False,
) -> bytes:
    """A finished `/generate`'s body: one item per sample (prompt-major), a list when `batched`; JSON,
    or with `packed` (the client accepts it, and no log-prob carries text) the packed reply.

    Built and serialized here, with Python's cyclic collector paused, rather than returned for FastAPI to
    serialize (the same pydantic-core serializer, the same bytes): the items are a burst of small lists
    (a triple per token) that live until they are written, and collections triggered while they are
    built each walk them and every object the engine made since start-up (its sequences, its prefix
    cache's nodes), on the HTTP thread, whose hold of the GIL the engine's scheduler waits for. Afterwards
    the lists are freed by their reference counts (no cycles). Figures: `benchmarks/engine_reply.py`,
    docs/measurements.md."""
    packed = packed and not text_in_logprobs
    with collector_paused():
        items = [
            final_item(r, job, tokenizer, text_in_logprobs, packed)
            for results, job in zip(groups, jobs, strict=True)
            for r in results
        ]
        body = items if batched else items[0]
        return packed_reply.encode(body) if packed else to_json(body)


def partial_item(
    p: Partial, job: Job, rid: str, text: str, tokenizer: Any, text_in_logprobs: bool, weight_version: str
) -> dict[str, Any]:
    """A streaming chunk: the sample's text and tokens so far (cumulative, as SGLang streams them)."""
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": None,
        "prompt_tokens": len(job.prompt),
        "completion_tokens": len(p.output_ids),
        "cached_tokens": 0,
        "weight_version": weight_version,
    }
    tok = tokenizer if text_in_logprobs else None
    meta.update(logprob_fields(job, p.output_ids, p.logprobs, p.top, tok))
    return {"text": text, "output_ids": list(p.output_ids), "meta_info": meta}
