"""The embedded engine's scheduling and KV bookkeeping: sequences and request groups, continuous batching
(admission, chunked prefill, decode batches, preemption), the block tables that place each sequence in the
paged KV cache, the prefix cache, and the per-row logit work (grammar masks, penalties) of a batch.

Layer: backends (ARCHITECTURE.md). Imports `embedded.model` and `embedded.sampling`; never `embedded.http`.
"""
