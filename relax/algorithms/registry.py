"""The algorithm registry: one name -> which pure functions make up the algorithm and what it needs.

To add an algorithm: write its reward normalizer in ``normalizers.py`` (register it in ``NORMALIZERS``),
its advantage estimator in ``advantages.py`` (``ESTIMATORS``) and its policy loss in
``policy_losses.py`` (``POLICY_LOSSES``) -- or reuse existing ones -- then register an
``AlgorithmSpec`` for it in ``ALGORITHMS`` below and give it a section in ``docs/algorithms.md``.
Nothing outside ``relax/algorithms`` needs to change: the trainer only receives a loss function.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True)
class AlgorithmSpec:
    """What an algorithm is made of, by name, and what the rest of Relax must provide for it."""

    name: str  # registry key, the value of ``algorithm.name`` in the config
    reward_normalizer: str  # key of normalizers.NORMALIZERS, applied per prompt group
    advantage_estimator: str  # key of advantages.ESTIMATORS
    policy_loss: str  # key of policy_losses.POLICY_LOSSES
    needs_critic: bool = False  # a value model is trained alongside the actor
    needs_reference: bool = False  # reference-model log-probs must be computed
    needs_complete_groups: bool = False  # every prompt group must arrive whole (size >= 2)
    on_policy_only: bool = False  # rollout may not run ahead of the trainer (max_staleness == 0)
    needs_teacher: bool = False  # teacher log-probs must be computed (on-policy distillation)
    paper: str = ""  # where the algorithm comes from
    # AlgorithmConfig fields this algorithm changes from the GRPO defaults; explicit user values win.
    config_defaults: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


def _spec(name: str, normalizer: str, estimator: str, loss: str, paper: str, **kw: Any) -> AlgorithmSpec:
    defaults = MappingProxyType(dict(kw.pop("config_defaults", {})))
    return AlgorithmSpec(name, normalizer, estimator, loss, paper=paper, config_defaults=defaults, **kw)


_GROUPED = {"needs_complete_groups": True}

ALGORITHMS: dict[str, AlgorithmSpec] = {
    s.name: s
    for s in [
        _spec(
            "grpo",
            "group_mean_std",
            "broadcast",
            "ppo_clip",
            "Shao et al. 2024, DeepSeekMath (arXiv:2402.03300)",
            **_GROUPED,
        ),
        _spec(
            "dr_grpo",
            "group_mean",
            "broadcast",
            "ppo_clip",
            "Liu et al. 2025, Understanding R1-Zero-Like Training (arXiv:2503.20783)",
            config_defaults={"loss_agg_mode": "seq_mean_token_sum_norm", "normalize_std": False},
            **_GROUPED,
        ),
        _spec(
            "dapo",
            "group_mean_std",
            "broadcast",
            "ppo_clip",
            "Yu et al. 2025, DAPO (arXiv:2503.14476)",
            config_defaults={"clip_eps_high": 0.28, "dynamic_sampling": True, "loss_agg_mode": "token_mean"},
            **_GROUPED,
        ),
        _spec(
            "ppo",
            "none",
            "gae",
            "ppo_clip",
            "Schulman et al. 2017, PPO (arXiv:1707.06347); GAE arXiv:1506.02438",
            needs_critic=True,
            config_defaults={"lam": 0.95},
        ),
        _spec(
            "rloo",
            "leave_one_out",
            "broadcast",
            "reinforce",
            "Ahmadian et al. 2024, Back to Basics: REINFORCE-style (arXiv:2402.14740)",
            on_policy_only=True,
            **_GROUPED,
        ),
        _spec(
            "reinforce_plus_plus",
            "none",
            "reinforce_plus_plus",
            "ppo_clip",
            "Hu 2025, REINFORCE++ (arXiv:2501.03262)",
        ),
        _spec(
            "reinforce_plus_plus_baseline",
            "group_mean",
            "reinforce_plus_plus",
            "ppo_clip",
            "Hu 2025, REINFORCE++ (arXiv:2501.03262), group-baseline variant",
            **_GROUPED,
        ),
        _spec(
            "gspo",
            "group_mean_std",
            "broadcast",
            "gspo",
            "Zheng et al. 2025, Group Sequence Policy Optimization (arXiv:2507.18071)",
            config_defaults={
                "clip_eps_low": 3e-4,
                "clip_eps_high": 4e-4,
                "loss_agg_mode": "seq_mean_token_mean",
            },
            **_GROUPED,
        ),
        _spec(
            "sapo",
            "group_mean_std",
            "broadcast",
            "sapo",
            "Gao et al. 2025, Soft Adaptive Policy Optimization (Qwen team)",
            config_defaults={"loss_agg_mode": "seq_mean_token_mean"},
            **_GROUPED,
        ),
        _spec(
            "cispo",
            "group_mean_std",
            "broadcast",
            "cispo",
            "MiniMax 2025, MiniMax-M1 (arXiv:2506.13585)",
            config_defaults={"clip_eps_low": 1.0, "clip_eps_high": 4.0},
            **_GROUPED,
        ),
        _spec(
            "m2po",
            "group_mean_std",
            "broadcast",
            "m2po",
            "Zheng, Zhao, Chen 2025, Prosperity before Collapse (M2PO, arXiv:2510.01161)",
            **_GROUPED,
        ),
        _spec(
            "on_policy_distillation",
            "none",
            "distillation",
            "ppo_clip",
            "Agarwal et al. 2024, GKD (arXiv:2306.13649); Thinking Machines 2025, On-Policy Distillation",
            needs_teacher=True,
            config_defaults={"distill_coef": 1.0},
        ),
    ]
}


# Config keys that only some pieces read, by piece: a key the selected algorithm's pieces do not read is
# refused when the user sets it (`AlgorithmConfig`), so a setting meant for another algorithm is never
# silently ignored. Keys every algorithm reads (KL, entropy, TIS, loss aggregation, ...) are not listed.
PIECE_KNOBS: dict[tuple[str, str], frozenset[str]] = {
    ("policy_loss", "ppo_clip"): frozenset({"clip_eps_low", "clip_eps_high", "dual_clip_c"}),
    ("policy_loss", "gspo"): frozenset({"clip_eps_low", "clip_eps_high"}),
    ("policy_loss", "cispo"): frozenset({"clip_eps_low", "clip_eps_high"}),
    ("policy_loss", "sapo"): frozenset({"sapo_tau_pos", "sapo_tau_neg"}),
    ("policy_loss", "m2po"): frozenset({"m2po_tau"}),
    ("reward_normalizer", "group_mean_std"): frozenset({"normalize_std"}),
    ("advantage_estimator", "gae"): frozenset({"gamma", "lam", "whiten_advantages"}),
    ("advantage_estimator", "reinforce_plus_plus"): frozenset({"gamma"}),
    ("needs_critic", "True"): frozenset({"value_clip", "value_loss_coef"}),
}
SPECIFIC_KNOBS: frozenset[str] = frozenset().union(*PIECE_KNOBS.values())


def knobs_read(spec: AlgorithmSpec) -> frozenset[str]:
    """The algorithm-specific config keys that `spec`'s pieces read."""
    pieces = {(kind, str(getattr(spec, kind))) for kind, _ in PIECE_KNOBS}
    return frozenset().union(*(knobs for piece, knobs in PIECE_KNOBS.items() if piece in pieces))


def get_algorithm(name: str) -> AlgorithmSpec:
    """The spec registered under ``name``; an unknown name raises ``ValueError`` listing the valid ones."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(
            f"unknown algorithm {name!r}; valid names: {', '.join(sorted(ALGORITHMS))}"
        ) from None
