"""Weight sync: versioned tensors from the trainer to engines and receivers: the broadcast group
(`sync_group`), the publisher (CUDA IPC or broadcast per receiver), receivers, CUDA IPC buffers.

Layer: weights/dataplane (ARCHITECTURE.md). May import engine_api, config, data, utils; nothing above.
"""
