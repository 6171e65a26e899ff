"""From the job's [model] section to the selected model's spec and resolved shape (generic over registered models)."""

from __future__ import annotations

import dataclasses

from meshrun.config import ConfigError, JobConfig, ModelConfig
from meshrun.models.shape import ModelShape
from meshrun.models.spec import ModelSpec, get_model_spec

SHAPE_FIELDS = tuple(f.name for f in dataclasses.fields(ModelShape))
"""[model] options that are shape fields: a non-zero value overrides the named size's."""


def model_spec(job: JobConfig | ModelConfig) -> ModelSpec:
    """The ModelSpec ``model.arch`` selects; ConfigError naming model.arch when there is none."""
    section = job.model if isinstance(job, JobConfig) else job
    try:
        return get_model_spec(section.arch)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def model_shape(job: JobConfig, corpus_vocab: int = 0) -> ModelShape:
    """The named size of ``model.arch`` with the non-zero overrides of ``job.model``; checks shapes against each
    other and the corpus's vocabulary, raising ConfigError naming the option."""
    m, spec = job.model, model_spec(job)
    if m.name not in spec.sizes:
        raise ConfigError(f"model.name={m.name!r} is not a named size of model.arch={m.arch!r}; choose one of "
                          f"{', '.join(spec.sizes)}")
    overrides = {name: getattr(m, name) for name in SHAPE_FIELDS
                 if isinstance(getattr(m, name), bool) or getattr(m, name)}
    cfg = dataclasses.replace(spec.sizes[m.name], **overrides)
    if cfg.dim % cfg.n_heads:
        raise ConfigError(f"model.dim={cfg.dim} is not divisible by model.n_heads={cfg.n_heads}")
    if cfg.n_heads % cfg.kv_heads:
        raise ConfigError(f"model.n_heads={cfg.n_heads} is not divisible by model.n_kv_heads={cfg.kv_heads}")
    if cfg.vocab_size < corpus_vocab:
        raise ConfigError(f"model.vocab_size={cfg.vocab_size} is smaller than the corpus needs ({corpus_vocab}); "
                          f"set --model.vocab_size={corpus_vocab} or more")
    return cfg


def resolved_model(model: ModelConfig, cfg: ModelShape) -> ModelConfig:
    """``model`` with the named size's values written out (a copy), so the saved config.toml is the whole truth."""
    values = {name: getattr(cfg, name) for name in SHAPE_FIELDS}
    return dataclasses.replace(model, **{**values, "n_kv_heads": cfg.kv_heads, "ffn_dim": cfg.hidden_dim})
