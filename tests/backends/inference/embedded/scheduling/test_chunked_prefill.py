"""Chunked prefill (`chunked_prefill.py`): greedy outputs are the same with it as without (with and
without a prefix-cache hit), a running decode keeps producing tokens while a long prompt is prefilled in
chunks, and a weight update, an abort or a retract during a chunked prefill leaves no half-prefilled
sequence behind."""

from __future__ import annotations

import argparse
import random
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from relax.backends.inference.embedded.engine import EmbeddedEngine
from relax.backends.inference.embedded.scheduling.chunked_prefill import ChunkedPrefill
from relax.backends.inference.embedded.scheduling.prefix_cache import BLOCK
from relax.backends.inference.registry import engine_kwargs
from relax.config.loader import ConfigError, load_config
from relax.entrypoints.engine_cmd import add_engine_parser

CHUNK = 32
BASE = ["model.path=m", "data.train_files=[d]"]  # the least a run config holds
GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}


def _rows_hold_nothing(s) -> bool:
    """No table row holds a KV block: every block in use is the prefix cache's alone."""
    return s.cache.used_blocks() == s.cache.cache_only and not any(s.cache.rows)


def _engine(
    model_dir,
    *,
    chunk: int,
    cache: bool = True,
    lean: bool = True,
    overlap: bool = False,
    right: bool = False,
) -> EmbeddedEngine:
    """`overlap`: CUDA's overlapped decode steps, on the CPU; `right`: CUDA's bottom-right causal
    attention of a lone chunk (`ModelRunner.prefill_after`; SDPA materialises it on the CPU)."""
    e = EmbeddedEngine(
        str(model_dir),
        device="cpu",
        dtype="float32",
        seed=0,
        enable_prefix_cache=cache,
        chunked_prefill_size=chunk,
        overlap=overlap,
    )
    if not lean:  # the `transformers` forward, which writes the cache through `update`
        e.runner.lean = None
    e.runner.lower_right = right
    return e.start()


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(n)]


@pytest.fixture
def chunk_runs(monkeypatch) -> list[int]:
    """The size of every chunk prefilled (a spy on `ChunkedPrefill.run`)."""
    sizes: list[int] = []
    run = ChunkedPrefill.run

    def spy(self, runner):
        before = self.done
        out = run(self, runner)
        sizes.append(self.done - before)
        return out

    monkeypatch.setattr(ChunkedPrefill, "run", spy)
    return sizes


def _workload(e: EmbeddedEngine) -> list[list[int]]:
    """Long prompts (several chunks) beside short ones and a running decode, n = 2 samples, then prompts
    that continue a cached prefix by more than a chunk, and the same prompt again (nearly all cached)."""
    outs = []
    system = _tokens(5 * CHUNK + 7, seed=1)
    futures = [
        e.submit(_tokens(9, seed=2), {**GREEDY, "max_new_tokens": 6}),  # finishes while one is chunked
        e.submit(_tokens(8 * CHUNK + 3, seed=3), {**GREEDY, "n": 2}),
        e.submit(_tokens(12, seed=4), GREEDY),
        e.submit(system + _tokens(5, seed=5), GREEDY),
    ]
    outs += [r.output_ids for f in futures for r in f.result(timeout=120)]
    hit = system + _tokens(3 * CHUNK + 1, seed=6)  # the system prompt's blocks cached, the rest chunked
    outs.append(e.generate(hit, GREEDY)[0].output_ids)
    outs.append(e.generate(hit, GREEDY)[0].output_ids)
    seeded = {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 3, "ignore_eos": True}
    outs.append(e.generate(_tokens(4 * CHUNK, seed=7), seeded)[0].output_ids)
    return outs


@pytest.mark.parametrize(
    ("lean", "cache", "overlap", "right"),
    [
        (True, True, False, False),
        (True, False, False, False),
        (False, True, False, False),
        (True, True, True, True),
    ],
    ids=["lean", "no-cache", "transformers", "overlap-lower-right"],
)
@pytest.mark.filterwarnings("ignore::UserWarning")  # SDPA: no fused kernel for the bottom-right mask on CPU
def test_outputs_with_chunking_equal_outputs_without(tiny_model_dir, chunk_runs, lean, cache, overlap, right):
    results = {}
    for chunk in (0, CHUNK):
        e = _engine(tiny_model_dir, chunk=chunk, cache=cache, lean=lean, overlap=overlap, right=right)
        try:
            results[chunk] = _workload(e)
            assert e.scheduler.chunked is None and _rows_hold_nothing(e.scheduler)
            hits = e.scheduler.prefix.hit_tokens if cache else 0
        finally:
            e.shutdown()
        if chunk == 0:
            assert chunk_runs == []
        if cache:
            assert hits > 5 * CHUNK  # the prefix-cache hit case was exercised
    assert len(chunk_runs) > 10 and max(chunk_runs) == CHUNK
    assert results[CHUNK] == results[0]


def _decode_tokens_during_prefill(model_dir, chunk: int, long_len: int) -> int:
    """Tokens a running request got between a long prompt's arrival in the scheduler and that prompt's
    first output token (all logged on the engine thread, in order)."""
    e = _engine(model_dir, chunk=chunk, cache=False)
    log: list[str] = []
    add = e.scheduler.add

    def logged_add(group):
        log.append(f"arrive {group.rid}")
        add(group)

    e.scheduler.add = logged_add
    started = threading.Event()

    def on_running(*_):
        log.append("running")
        started.set()

    try:
        running = e.submit(
            _tokens(10, seed=8), {**GREEDY, "max_new_tokens": 1500}, rid="running", on_token=on_running
        )
        assert started.wait(60)
        long = e.submit(_tokens(long_len, seed=9), GREEDY, rid="long", on_token=lambda *_: log.append("long"))
        long.result(timeout=120)
        e.abort("running")
        assert running.result(timeout=60)[0].finish_reason["type"] == "abort"  # still running throughout
    finally:
        e.shutdown()
    between = log[log.index("arrive long") : log.index("long")]
    return between.count("running")


def test_a_running_decode_keeps_producing_tokens_during_a_chunked_prefill(tiny_model_dir):
    long_len = 8 * CHUNK
    assert _decode_tokens_during_prefill(tiny_model_dir, 0, long_len) == 0
    # one decode step after each chunk but the last (after the last the prompt samples first)
    assert _decode_tokens_during_prefill(tiny_model_dir, CHUNK, long_len) == 8 - 1


def _perturbed(model_dir, out_dir) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(out_dir)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _reference(model_dir, prompt: list[int]) -> list[int]:
    e = _engine(model_dir, chunk=0, cache=False)
    try:
        return e.generate(prompt, GREEDY)[0].output_ids
    finally:
        e.shutdown()


@pytest.mark.parametrize("event", ["weight_update", "abort", "retract"])
def test_an_event_during_a_chunked_prefill_leaves_no_half_prefilled_sequence(tiny_model_dir, tmp_path, event):
    prompt = _tokens(8 * CHUNK + 5, seed=10)
    new_weights = _perturbed(tiny_model_dir, tmp_path / "new")
    want_old = _reference(tiny_model_dir, prompt)
    want_new = _reference(tmp_path / "new", prompt)
    assert want_new != want_old  # the update changes the output: a mix of the two would show
    e = _engine(tiny_model_dir, chunk=CHUNK, cache=True)
    s = e.scheduler
    fired = threading.Event()
    step = s.step

    def step_then_event() -> int:  # on the engine thread, between two steps (as a command runs)
        n = step()
        if not fired.is_set() and s.chunked is not None and s.chunked.done >= 3 * CHUNK:
            fired.set()
            if event == "weight_update":
                e.update_weights(new_weights.items(), weight_version="1")
            elif event == "abort":
                e.abort("long")
            else:
                e.pause(mode="retract")
            assert s.chunked is None  # nothing half prefilled stays
        return n

    s.step = step_then_event
    try:
        short = e.submit(_tokens(6, seed=11), {**GREEDY, "max_new_tokens": 4})  # runs beside, ends early
        out = e.submit(prompt, GREEDY, rid="long")
        assert fired.wait(60)
        if event == "retract":
            e.resume()
        got = out.result(timeout=120)[0]
        short.result(timeout=60)
        assert s.chunked is None and _rows_hold_nothing(s) and not s.running
        if event == "abort":
            assert got.finish_reason["type"] == "abort" and got.output_ids == []
            assert e.generate(prompt, GREEDY)[0].output_ids == want_old  # the engine serves on
        elif event == "weight_update":
            assert got.output_ids == want_new and got.weight_versions == ["1"]
            # the prompt was prefilled again from its start under the new weights
            assert s.prefix.hit_tokens == 0
        else:
            assert got.output_ids == want_old
    finally:
        e.shutdown()


def test_a_long_prompt_is_admitted_while_others_run(tiny_model_dir):
    """Without chunking a prompt above max_prefill_tokens waits until nothing runs; chunked, it is
    admitted beside the running batch and prefilled a chunk a step."""
    e = EmbeddedEngine(
        str(tiny_model_dir), device="cpu", dtype="float32", seed=0, max_prefill_tokens=4 * BLOCK,
        chunked_prefill_size=CHUNK,
    ).start()  # fmt: skip
    try:
        running = e.submit(_tokens(5, seed=12), {**GREEDY, "max_new_tokens": 1000}, rid="running")
        long = e.generate(_tokens(6 * CHUNK, seed=13), GREEDY)
        assert long[0].finish_reason["type"] == "length"
        assert not running.done()  # admitted while the other still ran
        e.abort("running")
    finally:
        e.shutdown()


def test_the_cli_flag_and_the_run_config_carry_the_chunk_size():
    parser = argparse.ArgumentParser()
    add_engine_parser(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["engine", "serve", "--model", "m"]).chunked_prefill_size is None
    args = parser.parse_args(["engine", "serve", "--model", "m", "--chunked-prefill-size", "-1"])
    assert args.chunked_prefill_size == -1
    cfg = load_config(None, [*BASE, "rollout.engine_chunked_prefill_size=2048"])
    assert engine_kwargs(cfg)["chunked_prefill_size"] == 2048
    assert engine_kwargs(load_config(None, BASE))["chunked_prefill_size"] is None  # the engine's default
    with pytest.raises(ConfigError):
        load_config(None, [*BASE, "rollout.engine_chunked_prefill_size=-2"])


@pytest.mark.parametrize(("given", "want"), [(None, 512), (0, 0), (-1, 0), (100, 100)])
def test_the_chunk_size_default_and_off(tiny_model_dir, given, want):
    e = EmbeddedEngine(str(tiny_model_dir), device="cpu", chunked_prefill_size=given)
    assert e.scheduler.chunk_size == want


@pytest.mark.parametrize("where", ["admission", "first_chunk", "middle_chunk", "joining"])
def test_a_failing_step_fails_the_prompt_being_prefilled_and_the_engine_serves_on(
    tiny_model_dir, monkeypatch, where
):
    """Taken from the queue, not yet running: a step that fails there fails the request (it had hung)."""
    e = _engine(tiny_model_dir, chunk=CHUNK, cache=False)
    s = e.scheduler
    failed = threading.Event()

    def once(fn):
        def wrapper(*a, **kw):
            if not failed.is_set():
                failed.set()
                raise RuntimeError("injected")
            return fn(*a, **kw)

        return wrapper

    if where == "admission":
        e.runner.prefill = once(e.runner.prefill)
    elif where == "joining":
        s._join = once(s._join)
    else:
        run, skip = ChunkedPrefill.run, 0 if where == "first_chunk" else 2

        def run_or_fail(c, runner):
            if c.done >= skip * CHUNK and not failed.is_set():
                failed.set()
                raise RuntimeError("injected")
            return run(c, runner)

        monkeypatch.setattr(ChunkedPrefill, "run", run_or_fail)
    try:
        prompt = _tokens(CHUNK - 4 if where == "admission" else 5 * CHUNK, seed=14)
        with pytest.raises(RuntimeError, match="injected"):
            e.submit(prompt, GREEDY).result(timeout=60)
        assert failed.is_set() and s.chunked is None and not s._admitting
        assert e.generate(prompt, GREEDY)[0].output_ids == _reference(tiny_model_dir, prompt)
    finally:
        e.shutdown()
