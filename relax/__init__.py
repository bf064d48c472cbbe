"""Relax: an asynchronous RL post-training engine for LLMs and omni-modal models."""

__version__ = "0.1.0"
