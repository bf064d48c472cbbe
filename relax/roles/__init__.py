"""Roles: plain classes that Ray Serve deploys one replica each (Actor, Rollout, ActorFwd/Reference,
Advantages, GenRM, Metrics); each is testable without Ray.

Layer: roles (ARCHITECTURE.md). May import ops, agentic, rollout and everything below; not orchestration.
"""
