"""The receive side of weight sync, shared by every receiver (the embedded engine, ActorFwd's model):
the weight-sync groups it joined, and one bucket's tensors taken from a group broadcast (flat or one per
tensor) or from a CUDA IPC handle of the trainer rank on its GPU.

What the tensors are loaded into is the receiver's business: `WeightInbox` hands them over and the
receiver copies them (`ModelWeightReceiver` into an `nn.Module`, the engine between two steps).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from relax.weights import ipc as weight_ipc
from relax.weights.sync_group import WeightSyncGroup, create_group, parse_dtype

logger = logging.getLogger(__name__)
T = TypeVar("T")


class WeightInbox:
    """The weight-sync groups of one receiver on `device`, by name."""

    def __init__(self, device: torch.device, join_timeout_s: float = 120.0) -> None:
        """`join_timeout_s`: a rendezvous not complete by then fails the join (an unreachable trainer
        never holds the receiver)."""
        self.device = device
        self.join_timeout_s = join_timeout_s
        self.groups: dict[str, WeightSyncGroup] = {}

    def join(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        """Join the trainer's group as rank `rank_offset` (replacing a group of that name); blocks until
        every rank has joined."""
        self.leave(group_name, missing_ok=True)
        self.groups[group_name] = create_group(
            master_address,
            master_port,
            rank_offset,
            world_size,
            backend,
            group_name,
            timeout_s=self.join_timeout_s,
            device=self.device if backend == "nccl" else None,
        )

    def leave(self, group_name: str, missing_ok: bool = False) -> None:
        if group_name not in self.groups:
            if missing_ok:
                return
            raise ValueError(f"no weight-sync group named {group_name!r}")
        self.groups.pop(group_name).destroy()

    def receive(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        load_format: str | None = None,
    ) -> dict[str, Tensor]:
        """One bucket from rank 0 of `group_name`: one broadcast of the packed bucket
        (`load_format="flattened_bucket"`) or one per tensor."""
        group = self.groups.get(group_name)
        if group is None:
            raise ValueError(
                f"no weight-sync group named {group_name!r}; call /init_weights_update_group first"
            )
        specs = list(zip(names, dtypes, shapes, strict=True))
        return group.receive_flat(specs) if load_format == weight_ipc.FLAT else group.receive(specs)

    def receive_ipc(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        handle: dict[str, Any],
        load: Callable[[dict[str, Tensor]], T],
    ) -> T:
        """One bucket from a CUDA buffer of the trainer rank on this GPU: `load` gets views into that
        buffer and must copy what it keeps; the copy is complete on return, so the sender may free it."""
        if self.device.type != "cuda":
            raise ValueError("weights by CUDA IPC need a receiver on a GPU; use the broadcast group")
        buf = weight_ipc.open_shared(handle)
        specs = [(n, parse_dtype(d), s) for n, d, s in zip(names, dtypes, shapes, strict=True)]
        out = load(weight_ipc.unpack(buf, specs))
        torch.cuda.synchronize(self.device)
        return out

    def close(self) -> None:
        """Leave every group."""
        for name in list(self.groups):
            self.leave(name)
