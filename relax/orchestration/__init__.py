"""Orchestration, the driver: the Controller (the training loop), the start checks, the roles'
deployment (Serve), the step flow and the stage roles of the streaming modes, the weight push and its
group, health, recovery, checkpoints and GPU planning. ARCHITECTURE.md ("The driver") draws how they meet.

Layer: orchestration (ARCHITECTURE.md). May import roles and everything below; not entrypoints.
"""
