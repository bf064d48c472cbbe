"""Operations: heartbeats, engine supervision and replacement, the elastic rollout API and manager,
notifications, metric sinks and step traces (docs/operations.md).

Layer: ops (ARCHITECTURE.md). May import rollout, backends and everything below them.
"""
