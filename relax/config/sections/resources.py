"""The `resources` section: GPUs and CPUs per role, placement on a heterogeneous cluster, the Ray cluster
and the address servers listen on."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from relax.data.config import Section

PLACEMENT_KEYS = (
    "rollout",
    "actor",
    "actor_fwd",
    "reference",
    "advantages",
    "genrm",
    "metrics",
    "engines",
    "ranks",
    "data_plane",
)


class PlacementConfig(Section):
    """Where one role (or the embedded engines, or the training ranks) may run on a heterogeneous
    cluster, in Ray's own terms (docs/cluster.md)."""

    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each replica/actor asks for (nodes started with "
        "`ray start --resources '{\"h200\": 8}'`), e.g. {h200: 1}.",
    )
    label_selector: dict[str, str] = Field(
        default_factory=dict,
        description="Node labels the replica/actor needs (nodes started with `ray start --labels "
        "tier=cpu`), e.g. {tier: cpu}; Ray's label selector syntax (`!value`, `in(a,b)`) works.",
    )


class ResourcesConfig(Section):
    """Where the roles run: GPUs and CPUs per role, the Ray cluster. How they take turns is `schedule`."""

    engine_gpus: float | None = Field(
        None,
        ge=0,
        description="GPUs per embedded engine (fractions share a GPU). None = auto "
        "(relax/orchestration/gpus.py): 0 without GPUs; colocate shares each GPU between a trainer rank and "
        "an engine; the other modes split the GPUs between engines and trainer.",
    )
    trainer_gpus: float | None = Field(
        None, ge=0, description="GPUs per training rank (None = auto, as for engine_gpus)."
    )
    fwd_gpus: float | None = Field(
        None, ge=0, description="fully_async: GPUs of the ActorFwd and Reference roles each (None = auto)."
    )
    num_cpus: int = Field(8, gt=0, description="Logical CPUs declared to a locally started Ray.")
    rollout_cpus: str | None = Field(
        None,
        description="CPU budget of rollout: pin the embedded engines, the Rollout role and Advantages to "
        "these CPUs ('0', '0-3,8'; relax/utils/cpu_affinity.py). None = any CPU.",
    )
    training_cpus: str | None = Field(
        None,
        description="CPU budget of training: pin the Actor (and its ranks), ActorFwd and Reference to these "
        "CPUs. None = any CPU.",
    )
    gpu_group: str | None = Field(
        None,
        description="Named Ray placement group of one-GPU bundles shared by colocated engines and training "
        "ranks (engine i and rank i use bundle i mod G); colocate on GPUs creates it (relax-gpus) if None.",
    )
    num_gpus: int | None = Field(
        None, ge=0, description="GPUs declared to a locally started Ray (None = every visible GPU)."
    )
    dashboard: bool = Field(
        False,
        description="Start Ray's dashboard with the local cluster Relax starts, listening on 127.0.0.1 only "
        "(its URL is logged; reach it from elsewhere through an SSH tunnel). A cluster Relax joins keeps "
        "its own dashboard settings.",
    )
    data_plane_cpus: float = Field(
        1.0,
        ge=0,
        description="Logical Ray CPUs of each TransferQueue actor (its controller and storage unit); where they "
        "go is resources.placement.data_plane.",
    )
    placement: dict[str, PlacementConfig] = Field(
        default_factory=dict,
        description=f"Where roles and actor groups go, by name ({', '.join(PLACEMENT_KEYS)}): custom "
        "resources and node labels; unnamed ones go anywhere (docs/cluster.md, examples/cluster.yaml).",
    )
    bind: Literal["auto", "loopback", "node"] = Field(
        "auto",
        description="Where the servers Relax starts (engines, weight receivers, elastic API, agent endpoint, "
        "doorbell, weight-sync rendezvous) listen and what they advertise: `loopback` = 127.0.0.1, `node` = "
        "the address of the node they run on (Ray's node IP; never all interfaces); `auto` = loopback when "
        "the cluster has one node at start, else node. Set `node` for a cluster that grows during the run.",
    )
    ray_address: str | None = Field(
        None,
        description="Existing Ray cluster to join (`auto`, `HOST:6379`, `ray://...`); None = the cluster in "
        "RAY_ADDRESS (set by `ray job submit`), else start a local one on 127.0.0.1 (docs/cluster.md).",
    )
    object_store_mb: int = Field(1024, gt=0, description="Object store size of a locally started Ray.")

    @field_validator("placement")
    @classmethod
    def _placement_keys(cls, value: dict[str, PlacementConfig]) -> dict[str, PlacementConfig]:
        if unknown := sorted(set(value) - set(PLACEMENT_KEYS)):
            raise ValueError(f"unknown placement key(s) {unknown}; valid keys: {', '.join(PLACEMENT_KEYS)}")
        return value

    @field_validator("rollout_cpus", "training_cpus", mode="before")
    @classmethod
    def _cpu_number(cls, value: Any) -> Any:
        """One CPU written as a number (YAML `0`; an override's value that looks like one reads as 0.0)."""
        if isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer():
            return str(int(value))
        return value

    @model_validator(mode="after")
    def _cpu_lists_parse(self) -> ResourcesConfig:
        from relax.utils.cpu_affinity import parse_cpu_list

        for key in ("rollout_cpus", "training_cpus"):
            if (value := getattr(self, key)) is not None:
                try:
                    parse_cpu_list(value)
                except ValueError as e:
                    raise ValueError(f"resources.{key}: {e}") from None
        return self
