"""From the job's [model] section to a model config (kept apart from gpt.py, which imports nothing of meshrun)."""

from __future__ import annotations

import dataclasses

from meshrun.config import ConfigError, JobConfig
from meshrun.models.gpt import GPT, GPTConfig, gpt_config


def model_config(job: JobConfig, corpus_vocab: int = 0) -> GPTConfig:
    """The named size with the non-zero overrides of ``job.model``; checks shapes against each other and the
    corpus's vocabulary, raising ConfigError naming the option."""
    m = job.model
    try:
        cfg = gpt_config(m.name, dim=m.dim, n_layers=m.n_layers, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads,
                         ffn_dim=m.ffn_dim, vocab_size=m.vocab_size, seq_len=m.seq_len)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    cfg = dataclasses.replace(cfg, dropout=m.dropout, rope_theta=m.rope_theta, norm_eps=m.norm_eps,
                              tie_embeddings=m.tie_embeddings)
    if cfg.dim % cfg.n_heads:
        raise ConfigError(f"model.dim={cfg.dim} is not divisible by model.n_heads={cfg.n_heads}")
    if cfg.n_heads % cfg.kv_heads:
        raise ConfigError(f"model.n_heads={cfg.n_heads} is not divisible by model.n_kv_heads={cfg.kv_heads}")
    if cfg.vocab_size < corpus_vocab:
        raise ConfigError(f"model.vocab_size={cfg.vocab_size} is smaller than the corpus needs ({corpus_vocab}); "
                          f"set --model.vocab_size={corpus_vocab} or more")
    return cfg


def record_resolved(job: JobConfig, cfg: GPTConfig) -> None:
    """Write the named size's values back into the config, so the saved config.toml is the whole truth."""
    for name in ("dim", "n_layers", "n_heads", "vocab_size", "seq_len"):
        setattr(job.model, name, getattr(cfg, name))
    job.model.n_kv_heads, job.model.ffn_dim = cfg.kv_heads, cfg.hidden_dim


def count_params(cfg: GPTConfig) -> int:
    """Unique parameters of the whole model, counted on the meta device (no memory)."""
    import torch

    with torch.device("meta"):
        return GPT(cfg).num_params()
