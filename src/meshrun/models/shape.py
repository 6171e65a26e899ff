"""The shape of a transformer: the one schema the built-in GPT, registered models and the job config share.

``[model]`` in the job config is this dataclass plus ``arch`` and ``name`` (meshrun.config.ModelConfig), with 0
meaning "the named size's value"; resolving it against a model's named sizes gives a ModelShape with every size
set, the one object that builders, tensor-parallel checks, the planner's formulas and FLOP counts read. It
imports nothing but the standard library, so model files can use it freely.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class ModelShape:
    """A transformer's shape. In the job config's [model] section (ModelConfig adds arch and name) a size left at
    0 takes the named size's value; a resolved shape (what builders receive) has every size set."""

    dim: int = 0
    """Hidden size."""
    n_layers: int = 0
    """Number of transformer blocks."""
    n_heads: int = 0
    """Attention heads."""
    vocab_size: int = 0
    """Embedding rows. Byte-level corpora use tokens 0..255; larger sizes only pad the embedding."""
    seq_len: int = 0
    """Tokens per sample (context length)."""
    n_kv_heads: int = 0
    """Key/value heads (grouped-query attention); 0 means n_heads."""
    ffn_dim: int = 0
    """Hidden width of the MLP; 0 derives it from dim (SwiGLU: 2/3 of 4 x dim, rounded up to 256)."""
    dropout: float = 0.0
    """Dropout probability on attention output and MLP output."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    norm_eps: float = 1e-5
    """Norm epsilon."""
    tie_embeddings: bool = True
    """Share the token embedding with the output projection."""

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        """SwiGLU width: 2/3 of 4*dim (same parameter count as a GELU MLP of 4*dim), rounded up to 256."""
        if self.ffn_dim:
            return self.ffn_dim
        return 256 * math.ceil(int(8 * self.dim / 3) / 256)
