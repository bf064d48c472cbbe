"""The receive side of weight sync, shared by every receiver (the embedded engine, ActorFwd's model):
the weight-sync groups it joined, and one bucket's tensors taken from a group broadcast (flat or one per
tensor) or from a CUDA IPC handle of the trainer rank on its GPU.

What the tensors are loaded into is the receiver's business: `WeightInbox` hands them over and the
receiver copies them (`ModelWeightReceiver` into an `nn.Module`, the engine between two steps).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

from relax.engine_api.protocol import (
    InitWeightsUpdateGroupRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromIpcRequest,
)
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

    def join(self, req: InitWeightsUpdateGroupRequest) -> None:
        """Join the trainer's group as rank `req.rank_offset` (replacing a group of that name); blocks
        until every rank has joined."""
        self.leave(req.group_name, missing_ok=True)
        self.groups[req.group_name] = create_group(
            req.master_address,
            req.master_port,
            req.rank_offset,
            req.world_size,
            req.backend,
            req.group_name,
            timeout_s=self.join_timeout_s,
            device=self.device if req.backend == "nccl" else None,
        )

    def leave(self, group_name: str, missing_ok: bool = False) -> None:
        if group_name not in self.groups:
            if missing_ok:
                return
            raise ValueError(f"no weight-sync group named {group_name!r}")
        self.groups.pop(group_name).destroy()

    def receive(self, req: UpdateWeightsFromDistributedRequest) -> dict[str, Tensor]:
        """One bucket from rank 0 of `req.group_name`: one broadcast of the packed bucket
        (`load_format="flattened_bucket"`) or one per tensor."""
        group = self.groups.get(req.group_name)
        if group is None:
            raise ValueError(
                f"no weight-sync group named {req.group_name!r}; call /init_weights_update_group first"
            )
        specs = list(zip(req.names, req.dtypes, req.shapes, strict=True))
        return group.receive_flat(specs) if req.load_format == weight_ipc.FLAT else group.receive(specs)

    def receive_ipc(self, req: UpdateWeightsFromIpcRequest, load: Callable[[dict[str, Tensor]], T]) -> T:
        """One bucket from a CUDA buffer of the trainer rank on this GPU: `load` gets views into that
        buffer and must copy what it keeps; the copy is complete on return, so the sender may free it."""
        if self.device.type != "cuda":
            raise ValueError("weights by CUDA IPC need a receiver on a GPU; use the broadcast group")
        buf = weight_ipc.open_shared(req.handle)
        specs = [(n, parse_dtype(d), s) for n, d, s in zip(req.names, req.dtypes, req.shapes, strict=True)]
        out = load(weight_ipc.unpack(buf, specs))
        torch.cuda.synchronize(self.device)
        return out

    def close(self) -> None:
        """Leave every group."""
        for name in list(self.groups):
            self.leave(name)
