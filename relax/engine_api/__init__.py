"""The HTTP contract of inference engines: SGLang's native API (`protocol`: request and response models;
`client`: the client every caller uses; `streaming`: server-sent events) and the OpenAI-compatible API
that engines and the agent endpoint serve alike (`openai`).

Layer: engine_api (ARCHITECTURE.md), below weights. May import config, data, utils.
"""
