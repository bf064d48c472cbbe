"""Helpers shared by the inference-engine tests."""

from __future__ import annotations

import asyncio

import torch

from relax.utils.net import free_port  # noqa: F401 - the tests import it from here


def run(coro):
    """Run a coroutine to completion (the tests are plain functions; no async plugin is needed)."""
    return asyncio.run(coro)


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


def engine_process(model_dir, *args: str, timeout_s: float = 120.0):
    """`relax engine serve` as a real process on a free port; returns (process, url) once it answers."""
    import os
    import subprocess
    import sys
    import time

    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "relax.entrypoints.engine_cmd", "serve", "--model", str(model_dir)]
    cmd += ["--port", str(port), "--dtype", "float32", *args]
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("engine did not come up")
        time.sleep(0.2)


def perturbed_model(model_dir, seed: int, scale: float = 0.5):
    """The model at `model_dir` with Gaussian noise added to every weight (what a trainer would push)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return model
