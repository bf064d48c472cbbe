"""The embedded engine's HTTP surface: the FastAPI server and its routers (SGLang-compatible generate,
control, info and health, OpenAI chat/completions, Prometheus `/metrics`), turning requests into calls
on `EmbeddedEngine` and its results back into SGLang- or OpenAI-shaped responses.

Layer: backends (ARCHITECTURE.md). Imports `embedded.engine` and the parts below it; nothing imports it
but entry points and tests.
"""
