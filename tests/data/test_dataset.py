"""Prompt data loading, tokenization, the resumable prompt stream, and the arithmetic toy generator."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from relax.data.dataset import DataError, PromptRow, PromptSource, load_prompts, tokenize_prompt
from relax.data.toy import arith_rows, generate_arith
from relax.models.tokenizer import train_tiny_tokenizer

ROWS = [
    {"prompt": "1+1=", "label": "2", "metadata": {"task": "arith"}},
    {"messages": [{"role": "user", "content": "hi"}], "label": {"answer": [1, 2]}},
    {"prompt": "no label"},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_load_jsonl(tmp_path):
    rows = load_prompts(write_jsonl(tmp_path / "d.jsonl", ROWS))
    assert rows == [
        PromptRow(0, "1+1=", "2", {"task": "arith"}),
        PromptRow(1, [{"role": "user", "content": "hi"}], {"answer": [1, 2]}, {}),
        PromptRow(2, "no label", None, {}),
    ]


def test_load_parquet(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"question": f"{i}+1=", "answer": str(i + 1)} for i in range(3)]), path
    )
    rows = load_prompts(path, prompt_key="question", label_key="answer")
    assert [(r.index, r.prompt, r.label, r.metadata) for r in rows] == [
        (0, "0+1=", "1", {}),
        (1, "1+1=", "2", {}),
        (2, "2+1=", "3", {}),
    ]


def test_parquet_messages(tmp_path):
    path = generate_arith(tmp_path / "m.parquet", n=5, messages=True)
    rows = load_prompts(path)
    assert rows[0].prompt == [{"role": "user", "content": rows[0].prompt[0]["content"]}]
    assert rows[0].metadata == {"task": "arith"}


@pytest.mark.parametrize(
    "bad, message",
    [
        (
            {"messages": "hi"},
            "line 2 of {path}: field 'messages' must be a list of {role, content} dicts, got str",
        ),
        ({"messages": []}, "field 'messages' must be a list of {role, content} dicts, got an empty list"),
        ({"messages": [{"content": "x"}]}, "message 0 is {'content': 'x'}"),
        ({"prompt": 3}, "line 2 of {path}: field 'prompt' must be a string, got int"),
        (
            {"text": "x"},
            "line 2 of {path}: needs a field 'messages' (list of {role, content} dicts) or 'prompt'",
        ),
        ({"prompt": "x", "metadata": [1]}, "line 2 of {path}: field 'metadata' must be a dict, got list"),
        ([1, 2], "line 2 of {path}: must be a JSON object, got list"),
    ],
)
def test_bad_rows(tmp_path, bad, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], bad])
    with pytest.raises(DataError) as err:
        load_prompts(path)
    assert message.replace("{path}", str(path)) in str(err.value)


def test_invalid_json_names_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n{not json\n")
    with pytest.raises(
        DataError, match=r"line 3 of .*broken.jsonl: invalid JSON .* each line must be one JSON object"
    ):
        load_prompts(path)


def test_bad_parquet_row_names_row(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "a"}, {"prompt": None}]), path)
    with pytest.raises(DataError, match=r"row 2 of .*d.parquet: needs a field 'messages'"):
        load_prompts(path)


def test_missing_file(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", ROWS)
    with pytest.raises(DataError) as err:
        load_prompts(tmp_path / "trian.jsonl")
    msg = str(err.value)
    assert f"prompt data file {tmp_path / 'trian.jsonl'} not found" in msg
    assert "train.jsonl" in msg.split("not found")[1] and "generate_arith" in msg
    with pytest.raises(DataError, match="does not exist"):
        load_prompts(tmp_path / "nowhere" / "x.jsonl")


def test_empty_file_and_bad_extension(tmp_path):
    (tmp_path / "e.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="holds no rows"):
        load_prompts(tmp_path / "e.jsonl")
    with pytest.raises(DataError, match=r"unsupported file extension '.csv'; use one of .jsonl, .parquet"):
        load_prompts(tmp_path / "d.csv")
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="cannot read as parquet"):
        load_prompts(tmp_path / "junk.parquet")


def test_data_error_is_value_error():
    assert issubclass(DataError, ValueError)


@pytest.fixture(scope="module")
def tok():
    return train_tiny_tokenizer(512)


def test_tokenize_prompt(tok):
    ids = tokenize_prompt(tok, "3+4=")
    text = tok.apply_chat_template(
        [{"role": "user", "content": "3+4="}], tokenize=False, add_generation_prompt=True
    )
    assert ids == tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids).endswith("<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenize_prompt(tok, "3+4=", system_prompt="Add.")
    assert tok.decode(ids).startswith("<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n")
    msgs = [{"role": "system", "content": "Mine."}, {"role": "user", "content": "x"}]
    assert tok.decode(tokenize_prompt(tok, msgs, system_prompt="Add.")).startswith(
        "<|im_start|>system\nMine."
    )
    assert tokenize_prompt(tok, "3+4=", apply_chat_template=False) == tok.encode(
        "3+4=", add_special_tokens=False
    )
    assert tok.convert_ids_to_tokens(tokenize_prompt(tok, "3+4=", apply_chat_template=False)) == list("3+4=")


def make_rows(n):
    return [PromptRow(i, f"p{i}") for i in range(n)]


def test_prompt_source_epochs_and_shuffle():
    src = PromptSource(make_rows(5), seed=1)
    first, second = src.next_batch(5), src.next_batch(5)
    assert sorted(r.index for r in first) == list(range(5)) == sorted(r.index for r in second)
    assert [r.index for r in first] != [r.index for r in second]  # reshuffled per epoch
    assert src.state_dict()["epoch"] == 1
    assert [r.index for r in PromptSource(make_rows(5), shuffle=False).next_batch(7)] == [0, 1, 2, 3, 4, 0, 1]
    assert [r.index for r in PromptSource(make_rows(5), seed=1).next_batch(5)] == [r.index for r in first]


def test_prompt_source_resume():
    rows = make_rows(7)
    src = PromptSource(rows, seed=5)
    src.next_batch(3)
    src.next_batch(6)  # crosses into epoch 1
    state = json.loads(json.dumps(src.state_dict()))
    expected = [r.index for r in src.next_batch(12)]
    resumed = PromptSource(rows, seed=5)
    resumed.load_state_dict(state)
    assert [r.index for r in resumed.next_batch(12)] == expected
    with pytest.raises(DataError, match="use the same data file and seed"):
        PromptSource(rows, seed=6).load_state_dict(state)
    assert next(iter(PromptSource(rows, shuffle=False))).index == 0


def test_generate_arith(tmp_path):
    path = generate_arith(tmp_path / "arith.jsonl", n=200, max_digit=4, seed=0)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(lines) == 200
    for row in lines:
        a, b = map(int, row["prompt"][:-1].split("+"))
        assert row["prompt"] == f"{a}+{b}=" and row["label"] == str(a + b)
        assert 0 <= a <= 4 and 0 <= b <= 4 and row["metadata"] == {"task": "arith"}
    assert {row["prompt"] for row in lines} == {f"{a}+{b}=" for a in range(5) for b in range(5)}
    assert arith_rows(50, seed=0) == lines[:50] and arith_rows(50, seed=1) != lines[:50]
    rows = load_prompts(generate_arith(tmp_path / "arith.parquet", n=10))
    assert [(r.prompt, r.label) for r in rows] == [(x["prompt"], x["label"]) for x in lines[:10]]
    with pytest.raises(ValueError, match="make them agree"):
        generate_arith(tmp_path / "x.parquet", fmt="jsonl")
