"""The engine fleet: the Rollout role's inference engines (embedded ones Relax starts, external ones it is
given), the supervisor that replaces failed engines, and the elastic API and manager that add and remove
engines during a run (docs/elastic_api.md).

Layer: fleet, beside ops (ARCHITECTURE.md). May import ops, rollout, backends and everything below them.
"""
