"""The data plane between roles: partitions per step, columns by producer, consumers by task name
(`plane`: the protocol and the in-process and Ray planes; `transferqueue`; `doorbell`; `samplers`).

Layer: weights/dataplane (ARCHITECTURE.md). May import config, data, utils; nothing above.
"""
