"""The OpenAI-compatible API (`/v1/models`, `/v1/completions`, `/v1/chat/completions`), written once and
served twice: by every embedded engine (over the engine itself) and by the agent endpoint of external
agents (over a session's token-in/token-out history and the rollout's engines). What differs between the
two is an `OpenAIBackend` (`backend.py`); requests, sampling, tools, constrained output, log-probs,
streaming and errors are here.

Modules: `schema` (request bodies), `convert` (request -> engine sampling parameters, tool grammars),
`replies` (responses and log-probs), `streaming` (chunks), `routes` (the FastAPI router), `tool_calls`
(Qwen's tool-call format), `messages` (messages and template options for the chat template), `errors`;
reasoning replies are split by `relax.data.reasoning`.

Layer: engine_api. May import config, data, utils.
"""
