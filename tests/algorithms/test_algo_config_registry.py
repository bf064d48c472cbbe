"""Registry and config: names, defaults, and the cross-section validation errors."""

import pytest
from pydantic import ValidationError

from relax.algorithms import ALGORITHMS, AlgorithmConfig, get_algorithm

REQUIRED = [
    "grpo", "dr_grpo", "ppo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
    "gspo", "sapo", "cispo", "m2po", "on_policy_distillation", "dapo",
]  # fmt: skip


def test_all_required_names_registered_and_resolvable():
    from relax.algorithms.advantages import ESTIMATORS
    from relax.algorithms.normalizers import NORMALIZERS
    from relax.algorithms.policy_losses import POLICY_LOSSES

    assert set(REQUIRED) <= set(ALGORITHMS)
    for spec in ALGORITHMS.values():
        assert spec.reward_normalizer in NORMALIZERS
        assert spec.advantage_estimator in ESTIMATORS
        assert spec.policy_loss in POLICY_LOSSES
        assert spec.paper
        AlgorithmConfig(name=spec.name)  # every algorithm's defaults are a valid config


def test_unknown_algorithm_lists_valid_names():
    with pytest.raises(ValueError, match="valid names: .*grpo.*rloo"):
        get_algorithm("nope")
    with pytest.raises(ValidationError, match="unknown algorithm 'nope'.*cispo"):
        AlgorithmConfig(name="nope")


def test_default_config_is_plain_grpo():
    c = AlgorithmConfig()
    assert c.name == "grpo" and c.spec.reward_normalizer == "group_mean_std"
    assert (c.clip_eps_low, c.clip_eps_high, c.dual_clip_c) == (0.2, 0.2, None)
    assert (c.kl_coef, c.reward_kl_coef, c.entropy_coef) == (0.0, 0.0, 0.0)
    assert c.loss_agg_mode == "token_mean" and c.normalize_std


def test_algorithm_defaults_fill_only_unset_fields():
    assert AlgorithmConfig(name="dapo").clip_eps_high == 0.28
    assert AlgorithmConfig(name="dapo", clip_eps_high=0.3).clip_eps_high == 0.3
    assert AlgorithmConfig(name="dr_grpo").loss_agg_mode == "seq_mean_token_sum_norm"
    assert AlgorithmConfig(name="gspo").clip_eps_low == 3e-4
    assert AlgorithmConfig(name="ppo").lam == 0.95


def test_extra_keys_forbidden():
    with pytest.raises(ValidationError, match="extra"):
        AlgorithmConfig(eps_clip=0.2)


def test_both_kl_sides_rejected():
    with pytest.raises(ValidationError, match="counted twice"):
        AlgorithmConfig(kl_coef=0.1, reward_kl_coef=0.1)


def test_custom_agg_needs_path():
    with pytest.raises(ValidationError, match="custom_loss_agg"):
        AlgorithmConfig(loss_agg_mode="custom")
    AlgorithmConfig(loss_agg_mode="custom", custom_loss_agg="pkg.mod:fn")


def test_dynamic_sampling_needs_groups():
    with pytest.raises(ValidationError, match="dynamic_sampling"):
        AlgorithmConfig(name="ppo", dynamic_sampling=True)


def test_validate_against_staleness_and_teacher():
    with pytest.raises(ValueError, match="on-policy only.*max_staleness=0"):
        AlgorithmConfig(name="rloo").validate_against(max_staleness=1, has_teacher=False)
    AlgorithmConfig(name="rloo").validate_against(max_staleness=0, has_teacher=False)
    AlgorithmConfig(name="grpo").validate_against(max_staleness=4, has_teacher=False)
    # the reference is always there (the initial policy): a KL term needs no extra model
    AlgorithmConfig(kl_coef=0.01).validate_against(max_staleness=0, has_teacher=False)
    with pytest.raises(ValueError, match="teacher.*model.reference_path"):
        AlgorithmConfig(name="on_policy_distillation").validate_against(0, has_teacher=False)
    with pytest.raises(ValueError, match="teacher"):
        AlgorithmConfig(distill_coef=0.5).validate_against(0, has_teacher=False)
    AlgorithmConfig(name="on_policy_distillation").validate_against(0, has_teacher=True)


def test_needs_reference_and_pi_old_properties():
    assert not AlgorithmConfig().needs_reference
    assert AlgorithmConfig(kl_coef=0.01).needs_reference
    assert AlgorithmConfig(reward_kl_coef=0.01).needs_reference
    assert AlgorithmConfig(name="on_policy_distillation").needs_reference  # the teacher serves it
    assert not AlgorithmConfig().pi_old_from_rollout
    assert AlgorithmConfig(old_log_probs="rollout").pi_old_from_rollout


@pytest.mark.parametrize(
    "name, key, value, readers",
    [
        ("grpo", "sapo_tau_pos", 2.0, "sapo"),
        ("grpo", "lam", 0.9, "ppo"),
        ("rloo", "clip_eps_high", 0.3, "grpo"),
        ("sapo", "m2po_tau", 0.1, "m2po"),
        ("grpo", "value_clip", 0.5, "ppo"),
    ],
)
def test_knobs_of_another_algorithm_are_refused(name, key, value, readers):
    with pytest.raises(ValidationError, match=rf"{name!r} does not read {key} \(read by .*{readers}"):
        AlgorithmConfig(name=name, **{key: value})


def test_knobs_of_the_algorithm_are_accepted():
    AlgorithmConfig(name="ppo", lam=0.9, gamma=0.99, value_clip=0.3, clip_eps_high=0.3)
    AlgorithmConfig(name="sapo", sapo_tau_pos=2.0)
    AlgorithmConfig(name="reinforce_plus_plus", gamma=0.99)
    AlgorithmConfig(name="grpo", normalize_std=False, dual_clip_c=3.0)
    AlgorithmConfig(name="dr_grpo")  # its own default normalize_std=False is not a user setting


def test_docs_have_one_section_per_algorithm():
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "algorithms.md").read_text()
    for name in ALGORITHMS:
        assert f"\n## {name}\n" in doc, f"docs/algorithms.md lacks a section for {name}"
