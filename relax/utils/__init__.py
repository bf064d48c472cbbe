"""Utilities with no knowledge of the rest of Relax: CPU affinity, gc freezing, logging, timing, sockets,
Ray placement helpers, micro-batching.

Layer: utils (ARCHITECTURE.md), the bottom. Imports nothing of Relax.
"""
