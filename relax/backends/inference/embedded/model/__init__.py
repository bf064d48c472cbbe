"""The embedded engine's model forward: the model runner over a Hugging Face causal LM, the lean decoder,
the paged KV cache it writes, the Triton kernels (decode attention, the fused attention step, prefill
rotary + cache write, SiLU-mul), decode CUDA graphs and prompt log-probs.

Layer: backends (ARCHITECTURE.md). Imports no other part of `embedded`.
"""
