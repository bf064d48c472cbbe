"""The embedded inference engine: a PyTorch engine over Hugging Face causal LMs with its own KV cache
and continuous batching, served over the SGLang-compatible HTTP protocol.

    engine = EmbeddedEngine("path/to/model"); engine.start()       # in process
    server = EngineServer("path/to/model", port=0); port = server.start()   # over HTTP

Layer: backends (ARCHITECTURE.md). May import weights, engine_api, config, data, models, utils.
"""
