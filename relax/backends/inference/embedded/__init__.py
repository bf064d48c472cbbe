"""The embedded inference engine: a PyTorch engine over Hugging Face causal LMs with its own KV cache
and continuous batching, served over the SGLang-compatible HTTP protocol.

    engine = EmbeddedEngine("path/to/model"); engine.start()       # in process
    server = EngineServer("path/to/model", port=0); port = server.start()   # over HTTP

Parts, each imported only by those above it (http -> engine -> scheduling -> model, sampling):
    engine.py     the engine thread: requests in, scheduler steps, weight updates, results out
    http/         the HTTP server and its routes (SGLang generate/control/info, OpenAI, /metrics)
    scheduling/   sequences, continuous batching, KV block tables, prefix cache, chunked prefill
    model/        the model runner, lean decoder, paged KV cache, Triton kernels, CUDA graphs
    sampling/     batched and fused sampling, grammar-constrained decoding

Layer: backends (ARCHITECTURE.md). May import weights, engine_api, config, data, models, utils.
"""
