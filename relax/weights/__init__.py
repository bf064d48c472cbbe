"""Weight sync: versioned tensors from the trainer to engines and receivers (docs/weights.md). Sending:
the `WeightSender` protocol and the one place a run builds it (`sender`), its transports (`publisher`:
a broadcast group with CUDA IPC beside it; `disk`: files), a training rank's driver (`rank_sender`).
Receiving: the one receive core (`inbox`) and ActorFwd's receiver (`receiver`). Shared: the group
(`sync_group`) and flat buckets / CUDA IPC buffers (`ipc`).

Layer: weights/dataplane (ARCHITECTURE.md). May import engine_api, config, data, utils; nothing above.
"""
