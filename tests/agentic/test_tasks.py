"""The calculator and search tasks: safe evaluation, the shaped rewards, the data generators and the
local document index."""

from __future__ import annotations

import json

import pytest

from relax.agentic.env import env_factory
from relax.agentic.tasks.calculator import calc_reward, evaluate
from relax.agentic.tasks.search import search_reward
from relax.data.sample import Sample
from relax.entrypoints.cli import main


def test_evaluate_is_arithmetic_only():
    assert evaluate("37*8") == 296 and evaluate("(1+2)*-3") == -9 and evaluate("7/2") == 3.5
    for bad in ("__import__('os')", "2**8", "x+1", "9" * 7 + "*" + "9" * 7, "1/0", ""):
        with pytest.raises(ValueError):
            evaluate(bad)


def _sample(label, turns):
    return Sample(index=0, prompt="", label=label, turns=turns)


def test_calc_reward_tiers():
    call = {"name": "calc", "arguments": {"expr": "37*8"}, "error": ""}
    assert calc_reward(_sample("296", [{"text": "296<|im_end|>"}]))["reward"] == 1.0  # right without tool
    assert calc_reward(_sample("296", [{"text": "12"}]))["reward"] == 0.0
    opened = _sample("296", [{"text": "<tool_call>zz", "tool_calls": [{**call, "error": "x"}]}])
    assert calc_reward(opened)["reward"] == pytest.approx(0.1)
    wrong_value = [{"text": "", "tool_calls": [call], "results": [{"ok": True, "text": "12", "error": ""}]}]
    assert calc_reward(_sample("296", [*wrong_value, {"text": "7"}]))["reward"] == pytest.approx(0.3)
    failed = [
        {"text": "", "tool_calls": [call], "results": [{"ok": False, "text": "Error", "error": "exception"}]}
    ]
    assert calc_reward(_sample("296", failed))["reward"] == pytest.approx(0.2)  # well formed, did not run
    right = [{"text": "", "tool_calls": [call], "results": [{"ok": True, "text": "296", "error": ""}]}]
    assert calc_reward(_sample("296", [*right, {"text": "29"}]))["reward"] == pytest.approx(0.5)
    r = calc_reward(_sample("296", [*right, {"text": "296<|im_end|>"}]))
    assert r["reward"] == 1.0 and r["tool_right_value"] == 1.0


def test_calculator_env_runs_compact_and_json_calls(tmp_path):
    from agentic_helpers import run

    from relax.agentic.env import ModelTurn
    from relax.agentic.parser import parse_tool_calls

    env = env_factory("calculator")(timeout_s=1.0)
    for text in (
        "<tool_call>37*8</tool_call>",
        '<tool_call>{"name": "calc", "arguments": {"expr": "37*8"}}</tool_call>',
    ):
        turn = ModelTurn(text, [], parse_tool_calls(text, env.compact_tool), "stop", 0)
        result = run(env.step(turn))
        assert not result.done and [m.content for m in result.observation] == ["296"]
    done = run(env.step(ModelTurn("296", [], parse_tool_calls("296"), "stop", 1)))
    assert done.done


def test_data_commands_and_search_index(tmp_path):
    assert main(["data", "calc", "--out", str(tmp_path / "calc.jsonl"), "--n", "20"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "calc.jsonl").read_text().splitlines()]
    assert len(rows) == 20 and all(evaluate(r["metadata"]["expr"]) == int(r["label"]) for r in rows)
    assert main(["data", "search", "--out", str(tmp_path / "search.jsonl"), "--n", "30", "--messages"]) == 0
    docs = tmp_path / "search_docs.jsonl"
    rows = [json.loads(x) for x in (tmp_path / "search.jsonl").read_text().splitlines()]
    env = env_factory("search")(index=str(docs))
    from agentic_helpers import run

    from relax.agentic.tools import call_tool

    for row in rows[:10]:
        country, fact = row["metadata"]["country"], row["metadata"]["fact"]
        query = {
            "capital": f"capital of {country}",
            "river": f"river of {country}",
            "colour": f"flag of {country}",
        }
        r = run(call_tool(env.by_name, "search", {"query": query[fact]}, 5.0))
        assert r.ok and row["label"] in r.text.split("\n")[0]  # the best hit states the answer
    with pytest.raises(FileNotFoundError, match="relax data search"):
        env_factory("search")(index=str(tmp_path / "missing.jsonl"))


def test_search_reward():
    res = [{"ok": True, "text": "The capital of Kalomi is Zuten.", "error": ""}]
    turns = [{"text": "", "tool_calls": [{"name": "search"}], "results": res}]
    assert search_reward(_sample("Zuten", [*turns, {"text": "Zuten<|im_end|>"}]))["reward"] == 1.0
    assert search_reward(_sample("Zuten", [*turns, {"text": "Paris"}]))["reward"] == pytest.approx(0.5)
    assert search_reward(_sample("Zuten", [{"text": "Paris"}]))["reward"] == 0.0
