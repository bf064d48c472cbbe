"""Config loading: YAML + dotted overrides, errors that name the key and the fix, resolved config dump."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from relax.config import ConfigError, dump_config, load_config
from relax.config.loader import parse_override

BASE = {"model": {"path": "m"}, "data": {"train_files": ["d.jsonl"]}}


@pytest.fixture
def cfg_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(BASE))
    return p


def test_defaults_and_overrides(cfg_file):
    cfg = load_config(
        cfg_file, ["algorithm.name=grpo", "rollout.n_samples_per_prompt=4", "rollout.stop=[a, b]"]
    )
    assert cfg.rollout.n_samples_per_prompt == 4
    assert cfg.rollout.stop == ["a", "b"]
    assert cfg.algorithm.name == "grpo"
    assert cfg.trainer.num_steps == 100


def test_override_value_types():
    assert parse_override("trainer.lr=1e-4") == (["trainer", "lr"], 1e-4)
    assert parse_override("run.name=abc") == (["run", "name"], "abc")
    assert parse_override("resources.ray_address=null") == (["resources", "ray_address"], None)
    with pytest.raises(ConfigError, match="key.path=value"):
        parse_override("trainer.lr")


def test_unknown_key_suggests_close_match(cfg_file):
    with pytest.raises(ConfigError) as e:
        load_config(cfg_file, ["rollout.n_sample_per_prompt=8"])
    msg = str(e.value)
    assert "unknown key 'rollout.n_sample_per_prompt'" in msg
    assert "Did you mean 'rollout.n_samples_per_prompt'" in msg


def test_unknown_section(cfg_file):
    with pytest.raises(ConfigError, match="unknown key 'trainr'.*Valid keys here: .*trainer"):
        load_config(cfg_file, ["trainr.lr=1"])


def test_invalid_values_name_accepted_ones(cfg_file):
    with pytest.raises(ConfigError, match="schedule.mode: Input should be 'colocate'"):
        load_config(cfg_file, ["schedule.mode=fast"])
    with pytest.raises(ConfigError, match="trainer.lr: Input should be greater than 0"):
        load_config(cfg_file, ["trainer.lr=-1"])
    with pytest.raises(ConfigError, match="valid names: .*grpo"):
        load_config(cfg_file, ["algorithm.name=grpp"])
    with pytest.raises(ConfigError, match="first_number"):
        load_config(cfg_file, ["reward.name=nope"])


def test_cross_section_checks(cfg_file):
    with pytest.raises(ConfigError, match="on-policy only"):
        load_config(cfg_file, ["algorithm.name=rloo", "schedule.max_staleness=1"])
    with pytest.raises(ConfigError, match="n_samples_per_prompt >= 2"):
        load_config(cfg_file, ["rollout.n_samples_per_prompt=1"])
    with pytest.raises(ConfigError, match="engine_urls"):
        load_config(cfg_file, ["rollout.engine=external"])
    # caught when the config loads, not when the Actor's replica fails to start three times
    with pytest.raises(ConfigError, match="'ppo' trains a critic.*schedule.mode=hybrid"):
        load_config(cfg_file, ["algorithm.name=ppo", "schedule.mode=fully_async", "schedule.max_staleness=1"])


def test_over_provision_needs_completion_order_in_a_streaming_mode(cfg_file):
    streaming = ["schedule.mode=fully_async", "schedule.max_staleness=1"]
    with pytest.raises(ConfigError, match="over_provision=4.*batch_order=completion"):
        load_config(cfg_file, ["rollout.over_provision=4", *streaming])
    with pytest.raises(ConfigError, match="colocate generates each step on request"):
        load_config(cfg_file, ["rollout.over_provision=4", "rollout.batch_order=completion"])
    cfg = load_config(cfg_file, ["rollout.over_provision=4", "rollout.batch_order=completion", *streaming])
    assert cfg.rollout.over_provision == 4


def test_overlap_push_needs_the_in_process_trainer(cfg_file):
    with pytest.raises(ConfigError, match="overlap_push=true needs the in-process trainer"):
        load_config(cfg_file, ["schedule.overlap_push=true", "trainer.backend=fsdp"])


def test_cpu_budgets_are_cpu_lists(cfg_file):
    cfg = load_config(cfg_file, ["resources.rollout_cpus=0", "resources.training_cpus=1-3,5"])
    assert (cfg.resources.rollout_cpus, cfg.resources.training_cpus) == ("0", "1-3,5")
    with pytest.raises(ConfigError, match=r"resources.training_cpus: CPU list '1-x'.*like '0' or '0-3,8'"):
        load_config(cfg_file, ["resources.training_cpus=1-x"])


def test_missing_required_and_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({"model": {"path": "m"}}))
    with pytest.raises(ConfigError, match="missing required key 'data'"):
        load_config(p)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    p.write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)
    with pytest.raises(ConfigError, match="is a value, not a section"):
        load_config(None, ["model=1", "model.path=2"])


def test_dump_round_trip(cfg_file, tmp_path):
    cfg = load_config(cfg_file, ["trainer.lr=0.01"])
    out = tmp_path / "resolved.yaml"
    dump_config(cfg, out)
    again = load_config(out)
    assert again == cfg


@pytest.mark.parametrize(
    "path", sorted((Path(__file__).parents[2] / "examples").glob("*.yaml")), ids=lambda p: p.name
)
def test_every_example_config_validates(path):
    """The shipped examples stay valid as the schema changes (the e2e tests start from tests/toy_arith.yaml)."""
    cfg = load_config(path)
    assert cfg.trainer.num_steps > 0


def test_auto_settings_resolve_to_what_runs(tmp_path):
    """config.yaml records what ran: the schedule's auto knobs are filled with what they resolve to."""
    from relax.config.modes import actor_fetches_ahead, overlaps_push, resolve_auto

    for mode in ("colocate", "hybrid", "fully_async"):
        cfg = load_config(None, ["model.path=m", "data.train_files=[d]", f"schedule.mode={mode}"])
        before = (overlaps_push(cfg), actor_fetches_ahead(cfg))
        resolve_auto(cfg)
        assert (cfg.schedule.overlap_push, cfg.schedule.fetch_ahead) == before
        assert (overlaps_push(cfg), actor_fetches_ahead(cfg)) == before


def test_moved_keys_still_work_with_a_warning():
    with pytest.warns(FutureWarning, match=r"resources.mode is now schedule.mode"):
        cfg = load_config(None, ["model.path=m", "data.train_files=[d]", "resources.mode=hybrid"])
    assert cfg.schedule.mode == "hybrid"
    with pytest.raises(ConfigError, match="both set"):
        load_config(
            None, ["model.path=m", "data.train_files=[d]", "resources.mode=hybrid", "schedule.mode=colocate"]
        )
