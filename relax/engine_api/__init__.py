"""The HTTP contract of inference engines (the subset of SGLang's native API that RL needs): request and
response models (`protocol`) and the client every caller uses (`client`).

Layer: engine_api (ARCHITECTURE.md), below weights. May import config, data, utils.
"""
