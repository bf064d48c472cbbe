"""Training backends: log-probs, values and `train_batch(batch, loss_fn)` over a causal LM, in process
(`torch_backend`) or as FSDP2 rank actors (`fsdp`, `rank_group`); checkpoints and export to a HF folder.

Layer: backends (ARCHITECTURE.md). May import weights, config, algorithms, data, models, utils.
"""
