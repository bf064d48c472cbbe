"""A weight-sync receiver for a training-side model (ActorFwd): the weight endpoints of the engines'
protocol (`/init_weights_update_group`, `/update_weights_from_distributed`, `/update_weights_from_ipc`,
`/destroy_weights_update_group`, `/get_model_info` with the GPU's UUID) on the address it is given
(`resources.bind`: 127.0.0.1 on one machine, the node's address on a cluster), so the trainer's
publisher treats the model like one more engine: a rank of its broadcast group on another GPU, a CUDA
IPC receiver on the trainer's own GPU; no host copy either way.

The owner decides when received weights count: `version` is the weight version of the last completed
push (the version the trainer sends with the last bucket).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

import torch
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from relax.engine_api.protocol import (
    DestroyWeightsUpdateGroupRequest,
    InitWeightsUpdateGroupRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromIpcRequest,
)
from relax.utils.auth import guard, process_token, server_tokens
from relax.utils.http_deadline import header_deadline_protocol
from relax.utils.http_limits import limit_requests
from relax.utils.tasks import in_daemon_thread
from relax.weights import ipc as weight_ipc
from relax.weights.inbox import WeightInbox

logger = logging.getLogger(__name__)
JOIN_TIMEOUT_S = 120.0  # a rendezvous not complete by then fails the join (an unreachable trainer)


class ModelWeightReceiver:
    """Loads received buckets (`WeightInbox`) into `model`'s parameters and buffers by name."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        # tied weights under each of their names (a sender may use either)
        self.params = {**dict(model.named_buffers()), **dict(model.named_parameters(remove_duplicate=False))}
        self.device = next(model.parameters()).device
        self.inbox = WeightInbox(self.device, JOIN_TIMEOUT_S)
        self.version: str | None = None
        self.loaded = 0  # tensors loaded since start (tests)

    def init_group(self, req: InitWeightsUpdateGroupRequest) -> None:
        self.inbox.join(req)

    def update(self, req: UpdateWeightsFromDistributedRequest) -> None:
        self.load(self.inbox.receive(req).items(), req.weight_version)

    def update_ipc(self, req: UpdateWeightsFromIpcRequest) -> None:
        """A bucket from a CUDA buffer of the trainer rank on this GPU; copied before this returns."""
        self.inbox.receive_ipc(req, lambda t: self.load(t.items(), req.weight_version))

    def load(self, named: Iterable[tuple[str, torch.Tensor]], weight_version: str | None) -> None:
        """Copy tensors into the model by name (unknown names are logged and skipped); `weight_version`
        (None for a bucket before the last) becomes the version the model holds."""
        unknown = []
        with torch.no_grad():
            for name, t in named:
                if name in self.params:
                    self.params[name].copy_(t)
                    self.loaded += 1
                else:
                    unknown.append(name)
        if unknown:
            logger.warning("weight receiver: %d unknown names ignored (e.g. %s)", len(unknown), unknown[0])
        if weight_version is not None:
            self.version = weight_version

    def destroy(self, req: DestroyWeightsUpdateGroupRequest) -> None:
        self.inbox.leave(req.group_name)


def build_receiver_app(receiver: ModelWeightReceiver) -> FastAPI:
    app = FastAPI(title="Relax weight receiver")

    async def call(fn: Any, req: Any, done: str) -> JSONResponse:
        try:
            await in_daemon_thread(fn, req)  # a stuck rendezvous holds no shared worker thread
        except (ValueError, KeyError, RuntimeError) as e:
            logger.warning("weight receiver %s failed: %s", fn.__name__, e)
            return JSONResponse({"success": False, "message": f"{fn.__name__} failed: {e}"}, status_code=400)
        return JSONResponse({"success": True, "message": f"Succeeded: {done}."})

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.post("/init_weights_update_group")
    async def init_group(req: InitWeightsUpdateGroupRequest) -> JSONResponse:
        return await call(receiver.init_group, req, "joined the weight update group")

    @app.post("/update_weights_from_distributed")
    async def update(req: UpdateWeightsFromDistributedRequest) -> JSONResponse:
        return await call(receiver.update, req, "weights updated")

    @app.post("/update_weights_from_ipc")
    async def update_ipc(req: UpdateWeightsFromIpcRequest) -> JSONResponse:
        return await call(receiver.update_ipc, req, "weights updated")

    @app.get("/get_model_info")
    async def model_info() -> dict:
        return {"device": str(receiver.device), "device_uuid": weight_ipc.device_uuid(receiver.device)}

    @app.post("/destroy_weights_update_group")
    async def destroy(req: DestroyWeightsUpdateGroupRequest) -> JSONResponse:
        return await call(receiver.destroy, req, "group destroyed")

    return app


class ReceiverServer:
    """Serves a `ModelWeightReceiver` with uvicorn in a daemon thread on `host` (port 0 = free)."""

    def __init__(
        self,
        receiver: ModelWeightReceiver,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
    ) -> None:
        """`api_key`: the bearer token every route but `/health` asks for; None = the run's token
        (relax/utils/auth.py), none outside a run."""
        import uvicorn

        self.receiver = receiver
        key = api_key or process_token()
        self.url: str | None = None
        # its own engine key too: Relax's clients (the weight publisher) send that (relax/utils/auth.py)
        app = limit_requests(
            guard(build_receiver_app(receiver), key, server_tokens(key, lambda: self.url or ""))
        )
        # a half-sent request head is timed out (`relax.utils.http_deadline`)
        config = uvicorn.Config(
            app, host=host, port=port, log_level="warning", http=header_deadline_protocol()
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="weight-receiver", daemon=True)
        self.host = host

    def start(self, timeout_s: float = 30.0) -> str:
        import time

        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not (self.server.started and self.server.servers):
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("weight receiver server did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{self.host}:{port}"
        return self.url

    def stop(self) -> None:
        if not self.thread.is_alive():
            return
        self.server.should_exit = True
        self.thread.join(timeout=10)
