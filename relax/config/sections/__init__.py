"""The config sections `relax.config.relax_config.RelaxConfig` nests, one module per top-level key (`run`,
`model`, `rollout`, `trainer`, `schedule`, `resources`, `ops`, `eval`); `data`, `algorithm` and `reward`
are owned by the layers that read them (relax/data/config.py, relax/algorithms/config.py,
relax/rewards/config.py). Import them from `relax.config`.

Layer: config (ARCHITECTURE.md). May import the sections it nests (rewards, algorithms, data) and utils.
"""
