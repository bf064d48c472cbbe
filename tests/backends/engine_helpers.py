"""Helpers shared by the inference-engine tests."""

from __future__ import annotations

import asyncio
import socket

import torch


def run(coro):
    """Run a coroutine to completion (the tests are plain functions; no async plugin is needed)."""
    return asyncio.run(coro)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log_softmax(model(prompt + output).logits) at the output tokens, [len(output)]."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
    return logp.gather(1, torch.tensor(output).unsqueeze(1)).squeeze(1)


def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]
