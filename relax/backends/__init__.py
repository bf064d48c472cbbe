"""Backends: the training backends (`training`: PyTorch in process or FSDP2 over Ray rank actors) and
the inference engines (`inference`: the embedded engine, SGLang), with the Ray actor groups that host them.

Layer: backends (ARCHITECTURE.md). May import weights, dataplane, engine_api and everything below them.
"""
