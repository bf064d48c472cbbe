"""A tiny GenRM judge trained in the test (plain torch, seconds on CPU) to answer with a strict verdict.

The verdict depends on one simple feature of the judge prompt: `Verdict: CORRECT` when the reference
answer is an even number, `Verdict: INCORRECT` when it is odd — whatever the response says. The prompts
are built exactly as `GenRMRole` builds them (template, then the judge tokenizer's chat template), with
responses of random tokens like those of an untrained tiny policy, so the judge behaves the same when
it judges a real run's samples through its own engine.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from relax.data.dataset import tokenize_prompt
from relax.models.tiny import write_tiny_model
from relax.rewards.genrm import render_judge_prompt

logger = logging.getLogger(__name__)

JUDGE_TEMPLATE = "Response: {response}\nReference: {reference}"
JUDGE_SYSTEM = "Judge."  # short: the default system prompt would triple the sequence length


def expected_verdict(reference: str) -> str:
    return "CORRECT" if int(reference) % 2 == 0 else "INCORRECT"


def _example(tokenizer, rng: random.Random, n_plain: int) -> tuple[list[int], list[int]]:
    """(prompt ids, target ids) of one random judge call."""
    a, b = rng.randint(0, 4), rng.randint(0, 4)
    reference = str(a + b)
    response_ids = [rng.randrange(n_plain) for _ in range(rng.randint(0, 4))]
    response = tokenizer.decode(response_ids, skip_special_tokens=True)
    text = render_judge_prompt(JUDGE_TEMPLATE, f"{a}+{b}=", response, reference)
    prompt = tokenize_prompt(tokenizer, text, True, JUDGE_SYSTEM)
    target = tokenizer.encode(f"Verdict: {expected_verdict(reference)}", add_special_tokens=False)
    return prompt, [*target, tokenizer.convert_tokens_to_ids("<|im_end|>")]


def _batch(examples: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, ...]:
    """Right-padded input ids [B, T], attention mask [B, T] and labels [B, T] (-100 off the targets)."""
    width = max(len(p) + len(t) for p, t in examples)
    ids_BT = torch.full((len(examples), width), pad_id)
    mask_BT = torch.zeros((len(examples), width), dtype=torch.long)
    labels_BT = torch.full((len(examples), width), -100)
    for row, (prompt, target) in enumerate(examples):
        seq = prompt + target
        ids_BT[row, : len(seq)] = torch.tensor(seq)
        mask_BT[row, : len(seq)] = 1
        labels_BT[row, len(prompt) : len(seq)] = torch.tensor(target)
    return ids_BT, mask_BT, labels_BT


def train_parity_judge(out_dir: Path, steps: int = 150, batch_size: int = 32, seed: int = 0) -> float:
    """Write a tiny model to `out_dir`, fine-tune it into the parity judge in place, and return its
    teacher-forced token accuracy on fresh examples (1.0 = every verdict token right)."""
    write_tiny_model(out_dir, family="qwen2", seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    n_plain = tokenizer.convert_tokens_to_ids("<|endoftext|>")  # ids below it are ordinary BPE tokens
    pad_id = tokenizer.pad_token_id or 0
    rng = random.Random(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for step in range(steps):
        ids_BT, mask_BT, labels_BT = _batch(
            [_example(tokenizer, rng, n_plain) for _ in range(batch_size)], pad_id
        )
        loss = model(input_ids=ids_BT, attention_mask=mask_BT, labels=labels_BT).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0:
            logger.info("judge sft step %d loss %.4f", step, loss.item())
    model.eval()
    ids_BT, mask_BT, labels_BT = _batch([_example(tokenizer, rng, n_plain) for _ in range(128)], pad_id)
    with torch.no_grad():
        logits_BTV = model(input_ids=ids_BT, attention_mask=mask_BT).logits
    pred_BT = logits_BTV[:, :-1].argmax(-1)  # position t predicts token t + 1
    target_BT = labels_BT[:, 1:]
    on_target = target_BT != -100
    accuracy = (pred_BT[on_target] == target_BT[on_target]).float().mean().item()
    model.save_pretrained(out_dir)
    return accuracy
