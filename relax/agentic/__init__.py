"""Agentic RL: multi-turn rollouts against environments and tools, an OpenAI-compatible endpoint for
external agent programs, and multi-agent samples (several contexts, several training rows).

Modules: `tools` (Tool, call_tool), `parser` (tool calls in a turn; from `relax.engine_api.openai`),
`env` (the Environment interface, ToolEnv), `turns` (turns as tokens), `multi_turn` (the episode loop),
`session` + `trajectory` (chat calls as an OpenAI backend, and their reconstruction), `openai_server`
(the agent endpoint), `external` (agent subprocesses), `dev_server` (`relax agent serve`),
`multi_agent`, `rollout` (what the rollout loop dispatches to), `tasks/` (calculator, search).

Layer: agentic (ARCHITECTURE.md). May import rollout and everything below it; not roles or ops.
"""
