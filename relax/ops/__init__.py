"""Operations: heartbeats, notifications, metric sinks, startup checks and step traces
(docs/operations.md). The engine fleet (supervision, replacement, the elastic API) is `relax.fleet`.

Layer: ops (ARCHITECTURE.md). May import rollout, backends and everything below them.
"""
