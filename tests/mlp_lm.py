"""A small language model that is not the built-in GPT, for the Session and model-contract tests.

Learned positions, pre-LayerNorm GELU MLP blocks without attention (an nn.ModuleList, as most user models have),
an output head with a bias (``tied=True`` shares its weight with the token embedding); ``forward`` skips the parts a pipeline stage does not hold. Its ``tp_plan`` shards each block's MLP Megatron-style (up column-parallel,
down row-parallel: the GELU between them is elementwise, so each rank applies it to its own columns).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshrun.models.shape import ModelShape
from meshrun.models.spec import ModelSpec, register_model


class MLPBlock(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))  # (B, T, C)


class MLPLM(nn.Module):
    tp_plan = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}

    def __init__(self, vocab: int = 64, dim: int = 32, hidden: int = 64, layers: int = 3, seq: int = 16,
                 tied: bool = False):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList([MLPBlock(dim, hidden) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        if tied:  # one (vocab, dim) matrix for the input embedding and the output head, as tie_word_embeddings
            self.head.weight = self.embed.weight

    @torch.no_grad()
    def init_weights(self, buffer_device=None) -> None:
        """Fill every parameter in place (after a meta-device build and to_empty)."""
        for module in self.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens (B, T) -> logits (B, T, V). As a pipeline stage it skips what the stage does not hold: later
        stages take the hidden states (B, T, C) instead of tokens, earlier ones return them."""
        h = x
        if self.embed is not None:
            h = self.embed(x) + self.pos(torch.arange(x.shape[1], device=x.device))  # (B, T, C)
        for block in self.blocks:
            if block is not None:
                h = block(h)
        if self.head is None:
            return h
        return self.head(self.norm(h))  # (B, T, V)


def build_from_shape(shape: ModelShape) -> MLPLM:
    return MLPLM(vocab=shape.vocab_size, dim=shape.dim, hidden=shape.hidden_dim, layers=shape.n_layers,
                 seq=shape.seq_len)


def mlp_block_params(m: ModelShape) -> tuple[int, int]:
    """(up and down matrices with biases, LayerNorm weight and bias)."""
    return 2 * m.dim * m.hidden_dim + m.hidden_dim + m.dim, 2 * m.dim


def mlp_edge_params(m: ModelShape, *, tied: bool) -> tuple[tuple[int, int], tuple[int, int]]:
    """Embeddings (tokens and positions) first; LayerNorm and the head with its bias last; all replicated."""
    return (0, (m.vocab_size + m.seq_len) * m.dim), (0, 2 * m.dim + (m.dim + 1) * m.vocab_size)


SPEC = register_model(ModelSpec(
    arch="mlp_lm", build=build_from_shape, blocks="blocks",
    sizes={"tiny": ModelShape(dim=32, n_layers=3, n_heads=1, vocab_size=64, seq_len=16, ffn_dim=64)},
    tp_plan=MLPLM.tp_plan, block_params=mlp_block_params, edge_params=mlp_edge_params,
    tp_checks=lambda m: [("model.ffn_dim (MLP width)", m.hidden_dim)]), replace=True)
