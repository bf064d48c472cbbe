"""Constrained decoding (regex, JSON schema, GBNF) always returns text that matches, at temperature 1 and
whatever the random tiny model prefers; a constrained neighbour does not change what an unconstrained,
seeded request generates; logit_bias steers sampling; a bad grammar is a 400 naming its field."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}


def generate(url: str, prompt: str, **params) -> list[dict]:
    body = {"text": prompt, "sampling_params": {"temperature": 1.0, "max_new_tokens": 48, **params}}
    resp = httpx.post(url + "/generate", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    return data if isinstance(data, list) else [data]


def test_regex_output_always_matches(engine_server):
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    for seed in range(3):
        for item in generate(engine_server.url, "code:", regex=pattern, n=4, sampling_seed=seed):
            assert re.fullmatch(pattern, item["text"]), item["text"]
            assert item["meta_info"]["finish_reason"]["type"] == "stop"


def test_json_schema_output_always_validates(engine_server):
    for item in generate(engine_server.url, "person:", json_schema=json.dumps(SCHEMA), n=6, sampling_seed=1):
        jsonschema.validate(json.loads(item["text"]), SCHEMA)
    # an object in place of the JSON string works too
    (item,) = generate(engine_server.url, "person:", json_schema=SCHEMA, sampling_seed=2)
    jsonschema.validate(json.loads(item["text"]), SCHEMA)


def test_gbnf_output_is_one_of_the_alternatives(engine_server):
    for item in generate(engine_server.url, "answer:", ebnf='root ::= "yes" | "no" | "maybe"', n=6):
        assert item["text"] in ("yes", "no", "maybe")


def test_constrained_neighbour_does_not_change_a_seeded_request(engine_server):
    free = {
        "input_ids": [7, 8, 9],
        "sampling_params": {"max_new_tokens": 12, "sampling_seed": 11, "ignore_eos": True},
    }
    alone = httpx.post(engine_server.url + "/generate", json=free, timeout=60).json()["output_ids"]
    body = {"input_ids": [[7, 8, 9], [3, 4]],
            "sampling_params": [free["sampling_params"], {"max_new_tokens": 12, "regex": "[a-c]+"}]}  # fmt: skip
    together = httpx.post(engine_server.url + "/generate", json=body, timeout=60).json()
    assert together[0]["output_ids"] == alone
    assert re.fullmatch("[a-c]+", together[1]["text"])


def test_logit_bias_steers_sampling(engine_server):
    body = {
        "input_ids": [1, 2],
        "sampling_params": {"max_new_tokens": 5, "ignore_eos": True, "logit_bias": {"42": 100.0}},
    }
    out = httpx.post(engine_server.url + "/generate", json=body, timeout=60).json()["output_ids"]
    assert out == [42] * 5


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"regex": "[0-9"}, "regex"),
        ({"json_schema": "{not json"}, "json_schema"),
        ({"ebnf": "root ::= ("}, "ebnf"),
        ({"logit_bias": {"9999999": 1.0}}, "logit_bias"),
    ],
)
def test_a_bad_constraint_is_a_400_naming_it(engine_server, params, needle):
    resp = httpx.post(
        engine_server.url + "/generate", json={"input_ids": [1], "sampling_params": params}, timeout=30
    )
    assert resp.status_code == 400 and needle in resp.json()["error"]["message"]
