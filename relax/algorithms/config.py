"""The ``algorithm`` section of the Relax config. ``AlgorithmConfig()`` is plain GRPO.

Algorithm-specific defaults (e.g. DAPO's clip-higher 0.28, GSPO's tiny clip range) come from the
registered ``AlgorithmSpec.config_defaults`` and are filled in only for fields the user left unset.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from relax.algorithms.registry import ALGORITHMS, SPECIFIC_KNOBS, AlgorithmSpec, get_algorithm, knobs_read

LossAggMode = Literal[
    "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm", "custom"
]
KLEstimator = Literal["k1", "k2", "k3", "low_var_kl"]
Divergence = Literal["reverse_kl", "forward_kl", "jsd"]


class AlgorithmConfig(BaseModel):
    """Which RL algorithm to run and its hyper-parameters (see docs/algorithms.md)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field("grpo", description="Registered algorithm name (relax.algorithms.registry.ALGORITHMS).")
    # -- policy loss --
    clip_eps_low: float = Field(0.2, gt=0, description="Lower clip: ratio clipped below at 1 - clip_eps_low.")
    clip_eps_high: float = Field(
        0.2, gt=0, description="Upper clip: ratio clipped above at 1 + clip_eps_high."
    )
    dual_clip_c: float | None = Field(
        None, gt=1, description="Dual clip: for A<0 the loss is capped at -c*A (c > 1); None = off."
    )
    loss_agg_mode: LossAggMode = Field(
        "token_mean", description="How per-token losses reduce to the global-batch loss (docs/algorithms.md)."
    )
    custom_loss_agg: str | None = Field(
        None,
        description="Import path 'pkg.module:fn' of a reducer, used when loss_agg_mode='custom'; "
        "contract in relax.algorithms.aggregation.CustomReducer.",
    )
    # -- rewards / advantages --
    normalize_std: bool = Field(True, description="GRPO: divide the group-centred reward by the group std.")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount per token for GAE and REINFORCE++ returns.")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda (bias/variance trade-off of PPO advantages).")
    whiten_advantages: bool = Field(True, description="GAE: whiten advantages over all masked tokens.")
    # -- KL and entropy --
    kl_coef: float = Field(0.0, ge=0, description="Loss-side KL-to-reference coefficient (0 = off).")
    kl_estimator: KLEstimator = Field("low_var_kl", description="KL estimator of the loss-side KL term.")
    reward_kl_coef: float = Field(
        0.0, ge=0, description="Reward-side KL coefficient: r_t -= coef*k1_t (0 = off)."
    )
    entropy_coef: float = Field(
        0.0, ge=0, description="Entropy bonus: loss -= coef * token entropy (0 = off)."
    )
    # -- algorithm-specific --
    sapo_tau_pos: float = Field(1.0, gt=0, description="SAPO gate temperature for tokens with A > 0.")
    sapo_tau_neg: float = Field(1.05, gt=0, description="SAPO gate temperature for tokens with A <= 0.")
    m2po_tau: float = Field(
        0.04, gt=0, description="M2PO budget on the mean squared log-ratio of the kept tokens."
    )
    # -- off-policy corrections against the engine's behaviour log-probs --
    old_log_probs: Literal["recompute", "rollout"] = Field(
        "recompute",
        description="pi_old of the PPO ratio: `recompute` forwards every sample through the weights that "
        "start the update (ActorFwd in fully_async); `rollout` takes the engine's behaviour log-probs "
        "and skips that forward (needs rollout.temperature 1; TIS/IcePop weights are then 1).",
    )
    tis: bool = Field(False, description="Truncated importance sampling: weight pg loss by clamp(pi_old/mu).")
    tis_clip_low: float = Field(0.0, ge=0, description="TIS weight lower clamp.")
    tis_clip_high: float = Field(2.0, gt=0, description="TIS weight upper clamp.")
    icepop: bool = Field(False, description="ICEPOP: drop tokens whose pi_old/mu lies outside the band.")
    icepop_low: float = Field(0.5, ge=0, description="ICEPOP band lower edge on pi_old/mu.")
    icepop_high: float = Field(5.0, gt=0, description="ICEPOP band upper edge on pi_old/mu.")
    opsm: bool = Field(
        False, description="Off-policy sequence masking: drop A<0 sequences too far off-policy."
    )
    opsm_delta: float = Field(
        1e-4, ge=0, description="OPSM threshold on the sequence's mean log(mu/pi_theta) (nats per token)."
    )
    # -- on-policy distillation --
    distill_coef: float = Field(0.0, ge=0, description="Weight of the per-token divergence to the teacher.")
    distill_divergence: Divergence = Field("reverse_kl", description="Divergence to the teacher.")
    distill_mode: Literal["advantage", "loss"] = Field(
        "advantage", description="Add -coef*divergence to the advantages, or coef*divergence to the loss."
    )
    # -- DAPO --
    dynamic_sampling: bool = Field(
        False, description="Rollout over-samples prompts and drops groups whose rewards all agree."
    )
    dynamic_sampling_max_rounds: int = Field(
        10, ge=1, description="Most generation rounds spent filling one batch under dynamic sampling."
    )
    overlong_buffer_len: int = Field(
        0, ge=0, description="Overlong shaping: last N tokens before max length are penalised (0 = off)."
    )
    overlong_penalty_factor: float = Field(1.0, ge=0, description="Overlong shaping: penalty at max length.")
    # -- critic --
    value_clip: float | None = Field(
        0.2, gt=0, description="PPO critic: value change clipped to +-value_clip around the old value."
    )
    value_loss_coef: float = Field(1.0, gt=0, description="Scale of the critic's value loss.")

    @model_validator(mode="before")
    @classmethod
    def _algorithm_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            spec = ALGORITHMS.get(data.get("name", "grpo"))
            if spec is not None:
                # a key at its default is what a dumped config (run folder's config.yaml) holds: harmless
                foreign = sorted(
                    k
                    for k in (set(data) & SPECIFIC_KNOBS) - knobs_read(spec)
                    if data[k] != cls.model_fields[k].default
                )
                if foreign:
                    readers = {
                        k: sorted(n for n, s in ALGORITHMS.items() if k in knobs_read(s)) for k in foreign
                    }
                    raise ValueError(
                        f"algorithm {spec.name!r} does not read "
                        + "; ".join(f"{k} (read by {', '.join(readers[k])})" for k in foreign)
                        + ": remove "
                        + ("it" if len(foreign) == 1 else "them")
                        + " or choose an algorithm that uses "
                        + ("it" if len(foreign) == 1 else "them")
                    )
                return {**spec.config_defaults, **data}
        return data

    @field_validator("name")
    @classmethod
    def _known_name(cls, name: str) -> str:
        get_algorithm(name)
        return name

    @model_validator(mode="after")
    def _consistent(self) -> AlgorithmConfig:
        if self.loss_agg_mode == "custom" and not self.custom_loss_agg:
            raise ValueError("loss_agg_mode='custom' needs custom_loss_agg='package.module:function'")
        if self.custom_loss_agg and ":" not in self.custom_loss_agg:
            raise ValueError(
                f"custom_loss_agg={self.custom_loss_agg!r} must look like 'package.module:function'"
            )
        if self.kl_coef > 0 and self.reward_kl_coef > 0:
            raise ValueError(
                "both kl_coef (loss-side KL) and reward_kl_coef (reward-side KL) are > 0; "
                "the KL would be counted twice -- set one of them to 0"
            )
        if self.icepop and self.icepop_low >= self.icepop_high:
            raise ValueError("icepop_low must be < icepop_high")
        if self.tis and self.tis_clip_low >= self.tis_clip_high:
            raise ValueError("tis_clip_low must be < tis_clip_high")
        if self.name == "on_policy_distillation" and self.distill_coef == 0:
            raise ValueError("on_policy_distillation needs distill_coef > 0 (the default is 1.0)")
        if self.dynamic_sampling and not get_algorithm(self.name).needs_complete_groups:
            raise ValueError(
                f"dynamic_sampling filters prompt groups, but {self.name!r} does not use groups; "
                "set dynamic_sampling=false or use a group algorithm (grpo, dapo, rloo, ...)"
            )
        return self

    @property
    def spec(self) -> AlgorithmSpec:
        """The registered spec of ``name``."""
        return get_algorithm(self.name)

    @property
    def needs_reference(self) -> bool:
        """Whether a run computes reference log-probs: the algorithm asks for them, a KL term is on, or
        the reference model serves as the distillation teacher (`model.reference_path`)."""
        spec = self.spec
        return (
            spec.needs_reference
            or spec.needs_teacher
            or self.kl_coef > 0
            or self.reward_kl_coef > 0
            or self.distill_coef > 0
        )

    @property
    def pi_old_from_rollout(self) -> bool:
        """pi_old is the engine's behaviour log-probs (`old_log_probs: rollout`): no forward pass computes
        it, and fully_async deploys no ActorFwd."""
        return self.old_log_probs == "rollout"

    def validate_against(self, max_staleness: int, *, has_teacher: bool) -> None:
        """Cross-section checks; raise ``ValueError`` saying how to fix the config.

        ``max_staleness``: how many weight versions rollout may run ahead of the trainer.
        ``has_teacher``: a teacher model distinct from the policy serves log-probs (`model.reference_path`);
        the reference itself always exists (the initial policy, when no other model is given).
        """
        spec = self.spec
        if spec.on_policy_only and max_staleness > 0:
            raise ValueError(
                f"algorithm {self.name!r} is on-policy only (unclipped policy gradient) but max_staleness="
                f"{max_staleness}; set max_staleness=0 or use an off-policy-robust algorithm (grpo, m2po, ...)"
            )
        if (spec.needs_teacher or self.distill_coef > 0) and not has_teacher:
            raise ValueError(
                "on-policy distillation (distill_coef > 0) needs a teacher: set model.reference_path to the "
                "teacher's model folder (without it the reference is the initial policy itself), or set "
                "distill_coef=0"
            )
