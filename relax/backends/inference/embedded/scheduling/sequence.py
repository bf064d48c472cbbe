"""Per-request state of the embedded engine: a `RequestGroup` (one prompt, n samples, one future) and its
`Sequence`s (one per sample), the finish rules, and the `GenerationResult` handed back.

Finish rules, checked after each sampled token, in order (before `min_new_tokens` tokens only the
grammar's end and the length ones): a stop token (EOS unless `ignore_eos`, or one of
`stop_token_ids`; the token is kept in `output_ids`), a stop string or stop regex (need the tokenizer; the
tokens are kept, the text is cut before the match unless `no_stop_trim`), the end of the request's
grammar (a constrained request whose grammar admits no further token), `max_new_tokens`, the context
length.

A request that streams gets `on_token(sample index, token, log-prob, top log-probs)` after each token,
on the engine thread (the callback must only hand the values on).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from relax.backends.inference.embedded.sampling.sampling import RowParams, make_generator
from relax.engine_api.protocol import SamplingParams
from relax.engine_api.stop_regex import compile_stop_regex

logger = logging.getLogger(__name__)
# the start of an abort's message when the output could not follow the request's grammar
GRAMMAR_ABORT = "grammar: "


@dataclass
class GenerationResult:
    """One finished sample, in the shape `/generate` reports it."""

    rid: str  # request id of this sample ("<rid>" for n = 1, "<rid>-<j>" for n > 1)
    output_ids: list[int]  # generated tokens, stop token included
    output_logprobs: list[float]  # log-prob of each generated token as the sampler saw it
    finish_reason: dict[str, Any]  # SGLang shape: {"type": "stop", "matched": ...} | length | abort
    prompt_tokens: int
    weight_version: str  # the engine's weight version when the sample finished
    text: str  # decoded output ("" without a tokenizer)
    e2e_latency: float  # seconds from submission to finish
    # the versions its tokens were sampled under, oldest first, and the output index where each began
    # (more than one when the weights changed while it ran: an update during a pause `in_place`)
    weight_versions: list[str] = field(default_factory=list)
    weight_version_starts: list[int] = field(default_factory=list)
    # the `top_logprobs_num` most likely tokens at each output position: [(log-prob, token id), ...]
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)


TopLogprobs = list[tuple[float, int]]  # the k most likely tokens at one position: (log-prob, token id)
OnToken = Callable[[int, int, float, "TopLogprobs | None"], None]


class Sequence:
    """One sample being generated. The cache holds prompt + outputs[:-1]; outputs[-1] is the next input."""

    def __init__(
        self, group: RequestGroup, index: int, generator: torch.Generator | None, matcher: Any = None
    ) -> None:
        self.group = group
        self.index = index
        self.rid = group.rid if group.params.n == 1 else f"{group.rid}-{index}"
        p = group.params
        self.row = RowParams(p.temperature, p.top_p, p.top_k, p.min_p, generator)
        self._max_new = p.max_new_tokens
        self._room = group.max_context_len - len(group.prompt)  # outputs that fill the context
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish: dict[str, Any] | None = None
        self.versions: list[tuple[int, str]] = []  # (output index, version) from the first weight change
        self.top_logprobs: list[TopLogprobs] = []  # filled when the request asks for top_logprobs_num
        self.matcher = matcher  # the grammar's state (`grammar.py`) of a constrained request, else None
        # rows that change their logits or want more than the sampled token's log-prob leave the
        # decode loop's fast path (`logit_rows.py`)
        self.special = (
            matcher is not None
            or bool(group.logit_bias)
            or group.top_logprobs_num > 0
            or bool(p.presence_penalty or p.frequency_penalty)
            or p.min_new_tokens > 0
        )
        self._extra = self.special or bool(group.params.stop_regexes) or group.on_token is not None

    def note_version(self, old: str, new: str) -> None:
        """The weights changed from `old` to `new` after this sequence's tokens so far (the next token is
        the first under `new`)."""
        if not self.output_ids:
            return
        if not self.versions:
            self.versions.append((0, old))
        if self.finish is None:  # a finished sample of a group still running keeps its old version
            self.versions.append((len(self.output_ids), new))

    @property
    def num_tokens(self) -> int:
        return len(self.group.prompt) + len(self.output_ids)

    def ends_by_length_next(self) -> bool:
        """Finished, or the next token finishes it by length whatever that token is."""
        n = len(self.output_ids) + 1
        return self.finish is not None or n >= self._max_new or n >= self._room

    def prefill_ids(self) -> list[int]:
        """The tokens a prefill of this sequence computes: prompt + output but its last token (the next
        step's input). Read only: without output it is the prompt list itself (admission asks for it
        several times a step, and an agent's prompt is thousands of tokens)."""
        out = self.output_ids
        return self.group.prompt + out[:-1] if len(out) > 1 else self.group.prompt

    def append(self, token: int, logprob: float, top: TopLogprobs | None = None) -> None:
        if self._extra:  # top log-probs, a grammar, stop regexes or streaming: off the common path
            self._append_extra(token, logprob, top)
            return
        out = self.output_ids
        out.append(token)
        self.logprobs.append(logprob)
        g = self.group
        if token in g.stop_ids:
            self.finish = {"type": "stop", "matched": token}
        elif g.stop_strings and (matched := self._matched_stop_string()) is not None:
            self.finish = {"type": "stop", "matched": matched}
        elif len(out) >= self._max_new:
            self.finish = {"type": "length", "length": self._max_new}
        elif len(out) >= self._room:
            self.finish = {"type": "length", "length": len(out)}

    def _append_extra(self, token: int, logprob: float, top: TopLogprobs | None) -> None:
        out = self.output_ids
        out.append(token)
        self.logprobs.append(logprob)
        g = self.group
        if g.top_logprobs_num > 0:
            self.top_logprobs.append(top or [])
        grammar_done = False
        if self.matcher is not None:
            if not self.matcher.consume_token(token):
                self.finish = {"type": "abort", "message": self._grammar_error(token)}
                return
            grammar_done = self.matcher.is_stopped()
        # before min_new_tokens no stop token (they are masked: `logit_rows.py`), string or regex ends it
        stops = len(out) >= g.params.min_new_tokens
        if stops and token in g.stop_ids:
            self.finish = {"type": "stop", "matched": token}
        elif stops and g.stop_strings and (matched := self._matched_stop_string()) is not None:
            self.finish = {"type": "stop", "matched": matched}
        elif stops and g.stop_regexes and (matched := self._matched_stop_regex()) is not None:
            self.finish = {"type": "stop", "matched": matched}
        elif grammar_done:
            self.finish = {"type": "stop", "matched": token}
        elif len(out) >= self._max_new:
            self.finish = {"type": "length", "length": self._max_new}
        elif len(out) >= self._room:
            self.finish = {"type": "length", "length": len(out)}
        if g.on_token is not None:
            g.on_token(self.index, token, logprob, top)

    def _grammar_error(self, token: int) -> str:
        """A short reason for a grammar the model could not follow (llguidance's error is the first line of
        a parser state dump; the dump is logged, not returned). Seen with a grammar whose literal text is
        one of the tokenizer's added tokens (`<tool_call>`), which the grammar matches as text and never
        as that token: write such a tag as a token (`<[id]>` in Lark) instead."""
        full = str(self.matcher.get_error() or "")
        logger.debug("grammar error of %s: %s", self.rid, full)
        first = full.strip().splitlines()[0] if full.strip() else "no token fits"
        shown = self.group.tokenizer.decode([token]) if self.group.tokenizer is not None else str(token)
        return (
            f"{GRAMMAR_ABORT}the output cannot follow the grammar at token {token} {shown!r} ({first[:200]})"
        )

    def _matched_stop_string(self) -> str | None:
        window = self.output_ids[-self.group.stop_window :]
        text = self.group.tokenizer.decode(window, skip_special_tokens=False)
        return next((s for s in self.group.stop_strings if s in text), None)

    def _matched_stop_regex(self) -> str | None:
        """The first stop regex found in the output text (decoded whole: a regex has no bounded length;
        only requests that give one pay for it). RE2 searches in time linear in the text, so no pattern
        can stall the engine thread (`relax.engine_api.stop_regex`)."""
        text = self.group.tokenizer.decode(self.output_ids, skip_special_tokens=False)
        for pattern in self.group.stop_regexes:
            if (m := pattern.search(text)) is not None:
                return m.group(0)
        return None

    def abort(self, message: str) -> None:
        if self.finish is None:
            self.finish = {"type": "abort", "message": message}


def decode_texts(tokenizer: Any, seqs: list[list[int]], skip_special_tokens: bool) -> list[str]:
    """`tokenizer.decode` of each of `seqs`. A fast tokenizer that cleans up no spaces decodes them in one
    call of its Rust backend, which is what its `decode` does per sequence after checking in Python that
    every id is a number: that check took ~0.3 us a token, 0.15 s of the step in which 256 rows of 1.8k
    tokens finished (docs/engines.md)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return [tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) for ids in seqs]
    return backend.decode_batch(seqs, skip_special_tokens=skip_special_tokens)


@dataclass
class RequestGroup:
    """One prompt with its n samples; `future` resolves with their results once all have finished."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    return_logprob: bool
    tokenizer: Any  # PreTrainedTokenizerBase | None
    stop_ids: set[int]
    max_context_len: int
    # media tensors of the prompt (forward kwargs of a multimodal model), None for text
    multimodal_inputs: dict[str, Any] | None = None
    rope_delta: int = 0  # rotary position minus cache column past the prompt (set by a multimodal prefill)
    top_logprobs_num: int = 0  # report the k most likely tokens at each output position
    grammar: Any = None  # the compiled output constraint (`grammar.Grammar`), None for free generation
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    on_token: OnToken | None = None  # streaming: called after each token (see the module docstring)
    future: Future = field(default_factory=Future)
    created: float = field(default_factory=time.monotonic)
    seqs: list[Sequence] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.stop_strings = self.params.stop_strings
        self.stop_window = max((len(s) for s in self.stop_strings), default=0) + 4  # tokens decoded per check
        self.stop_regexes = [compile_stop_regex(p) for p in self.params.stop_regexes]

    def make_sequences(self, device: torch.device) -> list[Sequence]:
        """The n samples. Sample j of a seeded request uses its own generator, seed `sampling_seed + j`;
        unseeded samples draw from the engine's shared generator."""
        p = self.params
        for j in range(p.n):
            gen = None
            if p.temperature > 0 and p.sampling_seed is not None:
                gen = make_generator(p.sampling_seed + j, device)
            matcher = self.grammar.matcher() if self.grammar is not None else None
            self.seqs.append(Sequence(self, j, gen, matcher))
        return self.seqs

    def done(self) -> bool:
        return all(s.finish is not None for s in self.seqs)

    def resolve(self, weight_version: str, texts: list[str] | None = None) -> None:
        """Hand the results to the waiting caller (call once, when `done()`); `texts`: the samples' texts,
        decoded already (`resolve_groups`)."""
        if self.future.done():
            return
        latency = time.monotonic() - self.created
        if texts is None:
            texts = [""] * len(self.seqs)
            if self.tokenizer is not None:
                skip = self.params.skip_special_tokens
                texts = decode_texts(self.tokenizer, [s.output_ids for s in self.seqs], skip)
        results = [self._result(s, t, weight_version, latency) for s, t in zip(self.seqs, texts, strict=True)]
        self.future.set_result(results)

    def _result(self, seq: Sequence, text: str, weight_version: str, latency: float) -> GenerationResult:
        if self.tokenizer is not None:
            matched = seq.finish.get("matched") if seq.finish else None
            if isinstance(matched, str) and matched and not self.params.no_stop_trim and matched in text:
                text = text[: text.index(matched)]
        return GenerationResult(
            rid=seq.rid,
            output_ids=list(seq.output_ids),
            output_logprobs=list(seq.logprobs) if self.return_logprob else [],
            finish_reason=dict(seq.finish or {"type": "abort", "message": "unfinished"}),
            prompt_tokens=len(self.prompt),
            weight_version=weight_version,
            text=text,
            e2e_latency=latency,
            weight_versions=[v for _, v in seq.versions] or [weight_version],
            weight_version_starts=[i for i, _ in seq.versions] or [0],
            output_top_logprobs=list(seq.top_logprobs),
        )


def resolve_groups(groups: list[RequestGroup], weight_version: str) -> None:
    """`resolve` each of `groups` (all done), the texts of those that share a tokenizer and its setting
    decoded in one batch: the Rust backend decodes a batch on all cores, and a step where a GRPO batch's
    256 rows finish is otherwise that many decodes one after another on the engine thread."""
    todo = [g for g in groups if not g.future.done()]
    batches: dict[tuple[int, bool], list[RequestGroup]] = {}
    for g in todo:
        if g.tokenizer is not None:
            batches.setdefault((id(g.tokenizer), g.params.skip_special_tokens), []).append(g)
    texts: dict[int, list[str]] = {}
    for (_, skip), same in batches.items():
        flat = decode_texts(same[0].tokenizer, [s.output_ids for g in same for s in g.seqs], skip)
        at = 0
        for g in same:
            texts[id(g)] = flat[at : at + len(g.seqs)]
            at += len(g.seqs)
    for g in todo:
        g.resolve(weight_version, texts.get(id(g)))
