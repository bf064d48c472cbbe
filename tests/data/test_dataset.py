"""Prompt data loading, tokenization, the resumable prompt stream, and the arithmetic toy generator."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from relax.data.config import DataConfig
from relax.data.dataset import (
    DataError,
    PromptRow,
    PromptSource,
    load_prompt_files,
    load_prompts,
    tokenize_prompt,
)
from relax.data.overlong import find_overlong, load_checked
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


def test_jsonl_with_a_byte_order_mark_loads(tmp_path):
    """Files saved by Windows tools start with a UTF-8 BOM; the rows read as without it."""
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in ROWS).encode())
    assert load_prompts(path) == load_prompts(write_jsonl(tmp_path / "plain.jsonl", ROWS))


def test_row_indices_run_on_across_files(tmp_path):
    """The rollout caches prompt tokens by row index: two files must not share one."""
    a = write_jsonl(tmp_path / "a.jsonl", ROWS[:2])
    b = write_jsonl(tmp_path / "b.jsonl", ROWS[2:])
    rows = load_prompt_files([str(a), str(b)], DataConfig(train_files=[str(a)]))
    assert [r.index for r in rows] == [0, 1, 2]
    assert rows[2].where == f"line 1 of {b}"


class CountingTokenizer:
    """The tiny tokenizer, counting how many texts it tokenizes."""

    def __init__(self, tok):
        self.tok, self.encoded = tok, 0

    def apply_chat_template(self, *args, **kwargs):
        return self.tok.apply_chat_template(*args, **kwargs)

    def encode(self, text, **kwargs):
        self.encoded += 1
        return self.tok.encode(text, **kwargs)


def overlong_data(tmp_path):
    """Twenty short rows with a 10 kB prompt on line 4 and chat messages of 3 kB on line 12."""
    rows = [{"prompt": f"{i}+1=", "label": str(i + 1)} for i in range(20)]
    rows[3] = {"prompt": "9" * 10_000, "label": "x"}
    rows[11] = {"messages": [{"role": "user", "content": "7" * 3_000}], "label": "x"}
    return write_jsonl(tmp_path / "train.jsonl", rows)


def test_overlong_prompts_dropped_and_counted_tokenizing_only_rows_that_may_be_too_long(tmp_path, tok):
    path = overlong_data(tmp_path)
    data = DataConfig(train_files=[str(path)], max_prompt_len=256)
    assert data.overlong_prompts == "drop"
    counting = CountingTokenizer(tok)
    kept, dropped = load_checked(data.train_files, data, counting, "data.train_files")
    assert [(o.row.where, o.tokens) for o in dropped] == [
        (f"line 4 of {path}", len(tokenize_prompt(tok, "9" * 10_000))),
        (f"line 12 of {path}", len(tokenize_prompt(tok, [{"role": "user", "content": "7" * 3_000}]))),
    ]
    assert [r.index for r in kept] == [i for i in range(20) if i not in (3, 11)]  # the rest is used
    assert counting.encoded == 2  # the short rows' byte bound cleared them without tokenizing


def test_overlong_prompts_error_names_file_line_and_keys(tmp_path, tok):
    path = overlong_data(tmp_path)
    data = DataConfig(train_files=[str(path)], max_prompt_len=256, overlong_prompts="error")
    with pytest.raises(DataError) as err:
        load_checked(data.train_files, data, tok, "data.train_files")
    msg = str(err.value)
    assert msg.startswith("data.train_files: 2 of 20 prompt(s) are longer than data.max_prompt_len=256")
    assert f"line 4 of {path} (" in msg and f"line 12 of {path} (" in msg
    assert "data.overlong_prompts=drop" in msg and "raise data.max_prompt_len" in msg


def test_nothing_left_after_dropping_is_an_error(tmp_path, tok):
    path = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "5" * 500}])
    data = DataConfig(train_files=[str(path)], max_prompt_len=64)
    with pytest.raises(DataError, match=r"every prompt \(1\) is longer than .* line 1 of"):
        load_checked(data.train_files, data, tok, "data.train_files")


def test_the_byte_bound_never_clears_a_row_that_is_too_long(tok):
    """Rows of mixed scripts, emoji and chat turns, each within a few tokens of the limit: the rows the
    bound clears without tokenizing are exactly those that fit."""
    import random

    rng = random.Random(0)
    alphabet = 'ab 1+=\n\u00e9\u4e2d\U0001f600<|>{}"'
    rows = []
    for i in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 120)))
        prompt = (
            text if i % 2 else [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}]
        )
        rows.append(PromptRow(i, prompt, where=f"line {i + 1}"))
    for system_prompt in (None, "Be brief."):
        for limit in (40, 80, 160):
            data = DataConfig(train_files=["x.jsonl"], max_prompt_len=limit, system_prompt=system_prompt)
            exact = [
                r.index for r in rows if len(tokenize_prompt(tok, r.prompt, True, system_prompt)) > limit
            ]
            assert exact and [o.row.index for o in find_overlong(rows, tok, data)] == exact
