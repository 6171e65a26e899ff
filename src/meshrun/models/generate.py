"""Sampling a continuation from a trained GPT (one process, no distributed code)."""

from __future__ import annotations

import torch

from meshrun.models.gpt import GPT

SMALL_MODEL_PARAMS = 5_000_000
"""Below this, sampling runs on one CPU thread (the tiny model: 50 tokens in 0.1 s instead of 1.7 s CPU time)."""


@torch.no_grad()
def generate(model: GPT, prompt: list[int], *, tokens: int, temperature: float = 0.8, top_k: int = 0,
             generator: torch.Generator | None = None) -> list[int]:
    """``tokens`` new token ids after ``prompt``. Temperature 0 is greedy; ``top_k`` > 0 samples among the k most
    likely. The context is cropped to the model's sequence length (no KV cache: the models here are small)."""
    model.eval()
    threads = torch.get_num_threads()
    if model.num_params() < SMALL_MODEL_PARAMS:
        torch.set_num_threads(1)  # a one-token step of a small model is too short to split: 15x faster measured
    try:
        return _sample(model, prompt, tokens=tokens, temperature=temperature, top_k=top_k, generator=generator)
    finally:
        torch.set_num_threads(threads)


def _sample(model: GPT, prompt: list[int], *, tokens: int, temperature: float, top_k: int,
            generator: torch.Generator | None) -> list[int]:
    seq = torch.tensor([prompt], dtype=torch.long)  # (1, T)
    for _ in range(tokens):
        logits = model(seq[:, -model.cfg.seq_len:])[:, -1, :].float()  # (1, V)
        if temperature <= 0:
            nxt = logits.argmax(dim=-1, keepdim=True)  # (1, 1)
        else:
            logits = logits / temperature
            if top_k > 0:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]  # (1, 1)
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)  # (1, 1)
        seq = torch.cat([seq, nxt], dim=1)
    return seq[0, len(prompt):].tolist()
