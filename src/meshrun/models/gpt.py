"""A decoder-only language model with a Llama-style block (RMSNorm, RoPE, SwiGLU, SDPA).

This file holds no distributed code and imports only the shape dataclass (meshrun.models.shape). Parallelisms are applied from outside (meshrun.parallel), which relies on:
* separate q/k/v/o and w1/w2/w3 linears (column/row-parallel plans),
* ``layers`` being a ModuleDict keyed by the layer index, so a pipeline stage can delete the layers it does not own
  and keep the original names (checkpoints then line up across layouts),
* ``tok_embeddings``, ``norm`` and ``output`` being optional (None on pipeline stages that do not own them),
* ``init_weights()`` initialising everything in place, so a model built on the meta device can be materialised
  shard by shard.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from meshrun.models.shape import ModelShape


GPTConfig = ModelShape
"""The GPT's config is the shared transformer shape (one schema for every registered transformer)."""


# Named sizes. 124m and 1b match the reference DDP numbers' models in parameter count (tied embeddings,
# GPT-2's 50304-row vocabulary); byte-level data only uses the first 256 rows.
SIZES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(dim=64, n_layers=2, n_heads=4, vocab_size=256, seq_len=64),
    "small": GPTConfig(dim=256, n_layers=4, n_heads=8, vocab_size=256, seq_len=256),
    "124m": GPTConfig(dim=768, n_layers=12, n_heads=12, vocab_size=50304, seq_len=1024),
    "350m": GPTConfig(dim=1024, n_layers=24, n_heads=16, vocab_size=50304, seq_len=1024),
    "1b": GPTConfig(dim=2048, n_layers=18, n_heads=16, vocab_size=50304, seq_len=2048, ffn_dim=5632),
}


def gpt_config(name: str, **overrides) -> GPTConfig:
    """The named size with the non-zero overrides applied."""
    if name not in SIZES:
        raise ValueError(f"model.name={name!r} is not a named size; choose one of {', '.join(SIZES)}")
    return replace(SIZES[name], **{k: v for k, v in overrides.items() if v})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # in the weight's dtype: fp32 under autocast whether the stream between blocks is fp32 or bf16
        # (train.residual_dtype; CPU autocast would otherwise normalise a bf16 input in bf16)
        out = F.rms_norm(x.to(self.weight.dtype), (x.shape[-1],), self.weight, self.eps)
        if torch.is_autocast_enabled(x.device.type):
            # the projections that read it would cast it anyway: returned in the autocast dtype, its gradient stays
            # in that dtype too, so TP's all-reduce of it at the block's input moves half the bytes
            out = out.to(torch.get_autocast_dtype(x.device.type))
        return out

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_cache(seq_len: int, head_dim: int, theta: float, device=None) -> torch.Tensor:
    """(T, hs/2, 2) cos/sin table; real-valued so it works with DTensor and compile."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), freqs)  # (T, hs/2)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    # x: (B, T, nh, hs); rope: (T, hs/2, 2)
    xr = x.float().unflatten(-1, (-1, 2))  # (B, T, nh, hs/2, 2)
    cos, sin = rope[: x.shape[1], None, :, 0], rope[: x.shape[1], None, :, 1]  # (T, 1, hs/2)
    out = torch.stack([xr[..., 0] * cos - xr[..., 1] * sin, xr[..., 0] * sin + xr[..., 1] * cos], dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.dropout = cfg.dropout
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 instead of n_heads: under tensor parallelism each rank holds only its share of the heads.
        q = self.wq(x).view(B, T, -1, self.head_dim)  # (B, T, nh, hs)
        k = self.wk(x).view(B, T, -1, self.head_dim)  # (B, T, nkv, hs)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1],
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh*hs)
        return self.resid_dropout(self.wo(y))


class FeedForward(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)  # up
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)  # down
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope", rope_cache(cfg.seq_len, cfg.head_dim, cfg.rope_theta), persistent=False)

    def forward(self, tokens: torch.Tensor, *, head: bool = True) -> torch.Tensor:
        """tokens (B, T) int64 -> logits (B, T, V). On a middle pipeline stage: hidden (B, T, C) -> (B, T, C).
        ``head=False`` stops before the output projection (for a loss that applies it itself, chunk by chunk)."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens  # (B, T, C)
        for layer in self.layers.values():
            h = layer(h, self.rope)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None and head else h

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """(Re)initialise every parameter and buffer in place; works on DTensor shards after meta init.

        Normal(0, 0.02) for embeddings and input projections; output projections of each residual branch are
        scaled by 1/sqrt(2 * n_layers) (GPT-2).
        """
        device = buffer_device or (self.rope.device if self.rope.device.type != "meta" else None)
        self.rope = rope_cache(self.cfg.seq_len, self.cfg.head_dim, self.cfg.rope_theta, device=device)
        std, out_std = 0.02, 0.02 / math.sqrt(2 * self.cfg.n_layers)
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight, std=std)
        for layer in self.layers.values():
            for lin in (layer.attention.wq, layer.attention.wk, layer.attention.wv, layer.feed_forward.w1,
                        layer.feed_forward.w3):
                nn.init.normal_(lin.weight, std=std)
            nn.init.normal_(layer.attention.wo.weight, std=out_std)
            nn.init.normal_(layer.feed_forward.w2.weight, std=out_std)
            layer.attention_norm.reset_parameters()
            layer.ffn_norm.reset_parameters()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None and not self.cfg.tie_embeddings:
            nn.init.normal_(self.output.weight, std=std)

    def num_params(self, *, embedding: bool = True) -> int:
        """Unique parameters; without the input embedding when embedding=False (the output head still counts)."""
        params = {id(p): p for p in self.parameters()}
        total = sum(p.numel() for p in params.values())
        if not embedding and self.tok_embeddings is not None and not self.cfg.tie_embeddings:
            total -= self.tok_embeddings.weight.numel()
        return total

