"""Orchestration: the Controller (the training loop), the step flow of the streaming modes, the weight
push and its group, role deployment (Serve), health, recovery, checkpoints and GPU planning.

Layer: orchestration (ARCHITECTURE.md). May import roles and everything below; not entrypoints.
"""
