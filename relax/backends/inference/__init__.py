"""Inference engines: the embedded engine (`embedded`), SGLang servers (`sglang`, `launcher`) and the Ray
actors that host embedded engines (`engine_actors`), and the registry of engine backends that a run's
`rollout.engine` names (`registry`). Every engine speaks the HTTP contract of `relax.engine_api`.

Layer: backends (ARCHITECTURE.md). May import weights, engine_api, config, data, models, utils.
"""
