"""A finished request group's texts (`sequence.decode_texts`, `resolve_groups`) are what the tokenizer's
own `decode` gives, through the batched fast path and through the fallback alike, and groups resolved
together each get their own samples' texts."""

from __future__ import annotations

import random

import pytest
import torch

from relax.backends.inference.embedded.scheduling.sequence import RequestGroup, decode_texts, resolve_groups
from relax.engine_api.protocol import SamplingParams
from relax.models.tokenizer import train_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return train_tiny_tokenizer(512)


def _rows(tokenizer, n: int = 6) -> list[list[int]]:
    rng = random.Random(0)
    special = sorted(tokenizer.all_special_ids)
    rows = [[rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 200))] for _ in range(n)]
    rows[0] = special + rows[0][:10] + special  # special tokens inside the text too
    rows[1] = []
    return rows


@pytest.mark.parametrize("skip", [True, False])
def test_the_batched_decode_equals_the_tokenizers_decode(tokenizer, skip):
    assert tokenizer.backend_tokenizer is not None and not tokenizer.clean_up_tokenization_spaces
    rows = _rows(tokenizer)
    assert decode_texts(tokenizer, rows, skip) == [
        tokenizer.decode(r, skip_special_tokens=skip) for r in rows
    ]


def test_a_tokenizer_without_a_fast_backend_decodes_row_by_row(tokenizer):
    class Plain:  # a slow tokenizer or a processor: only `decode`
        calls = 0

        def decode(self, ids, skip_special_tokens):
            Plain.calls += 1
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    rows = _rows(tokenizer)
    assert decode_texts(Plain(), rows, True) == [tokenizer.decode(r, skip_special_tokens=True) for r in rows]
    assert Plain.calls == len(rows)


def test_groups_resolved_together_get_their_own_samples_texts(tokenizer):
    rows = _rows(tokenizer, 7)
    settings = [(tokenizer, True, 2), (tokenizer, False, 3), (None, True, 1), (tokenizer, True, 1)]
    groups, at = [], 0
    for i, (tok, skip, n) in enumerate(settings):
        params = SamplingParams(n=n, skip_special_tokens=skip, max_new_tokens=8)
        g = RequestGroup(f"r{i}", [1, 2, 3], params, False, tok, set(), 64)
        for s in g.make_sequences(torch.device("cpu")):
            s.output_ids = rows[at]
            s.finish = {"type": "length", "length": len(rows[at])}
            at += 1
        groups.append(g)
    resolve_groups(groups, "3")
    at = 0
    for tok, skip, n in settings:
        results = groups.pop(0).future.result(timeout=0)
        assert [r.output_ids for r in results] == rows[at : at + n]
        want = [tok.decode(r, skip_special_tokens=skip) if tok else "" for r in rows[at : at + n]]
        assert [r.text for r in results] == want and {r.weight_version for r in results} == {"3"}
        at += n
