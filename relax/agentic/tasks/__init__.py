"""Built-in agentic tasks (calculator, search): their environments, tools, data and rewards.

Layer: agentic (ARCHITECTURE.md). May import rollout and everything below it.
"""
