"""The embedded engine's token choice: batched sampling (temperature, top-p/k, min-p, per-request
seeded generators), the fused Triton sampler, and grammar-constrained decoding through llguidance.

Layer: backends (ARCHITECTURE.md). Imports no other part of `embedded`.
"""
