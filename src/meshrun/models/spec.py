"""The model contract: what meshrun must know about a model to build, shard, pipeline, count and check it.

A :class:`ModelSpec` says, for one architecture:

* ``build(shape)``: the whole model from its :class:`~meshrun.models.shape.ModelShape` (meshrun calls it under
  ``torch.device("meta")``, so nothing is allocated), and ``init_weights(model, device)`` to fill it in place
  after ``to_empty`` (it must work on DTensor shards: use ``nn.init`` functions, not assignments);
* ``blocks``: the attribute holding the repeated blocks, an ``nn.ModuleDict`` keyed by layer index ("0", "1",
  ...). They are the FSDP units, the activation-checkpointing units and the pipeline split points;
  ``first_stage`` / ``last_stage`` name the modules only the first / last pipeline stage keeps (set to None
  elsewhere, so ``forward`` must skip a None module);
* ``tp_plan``: tensor parallelism, either a dict ``{module name or glob: "colwise" | "rowwise" | ParallelStyle}``
  or a function ``(part, tp_mesh, *, sequence_parallel, loss_parallel)`` applying it in place; None = no TP;
* ``tie_weights``: re-tie shared parameters after ``to_empty`` (None when nothing is shared);
* the formulas the planner and the trainer's MFU use: ``block_params`` (matrix and norm parameters of one block),
  ``edge_params`` (embedding, head and final norm) and ``flops_per_token``, by default those of a Llama-style
  model (see the functions below);
* ``sequence_buffers``: the buffers indexed by sequence position (a RoPE table) and their sequence dimension:
  context parallelism shards them together with the tokens, so each rank's positions match its part of the
  sequence; None = the model does not support context parallelism;
* ``tp_checks``: the sizes tensor parallelism must divide (heads, widths, vocabulary) and ``validate``: any
  other check of a shape against a layout. Both raise ConfigError naming the option;
* the loss: ``hidden_states(model, tokens)`` and ``head_weight(model)``, the output head's input and its weight,
  for ``train.loss=chunked`` (None: the model does not support it), and ``aux_loss(model)``, an auxiliary term
  (an MoE router's load-balancing loss) the engines add to the training objective after each forward.

The fields that describe a built model (where its blocks are, what stays on the first and last pipeline stage, its
tensor-parallel plan, tied weights, position buffers and the loss hooks) form :class:`ModelStructure`, which is
all that ``meshrun.parallel`` reads; a ModelSpec is a ModelStructure plus how to build, initialise, size and count
the model. ``Session.prepare_model`` describes a user's already built model by a ModelStructure alone.

The built-in GPT is one spec (meshrun.models.gpt_spec); ``register_model(spec)`` adds another, and
``--model.arch=NAME`` (or ``module:NAME``, importing ``module`` first) selects it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

from meshrun.models.shape import ModelShape

from torch import nn

if TYPE_CHECKING:
    import torch


def count_unique_params(modules: Iterable[nn.Module], *, local: bool = False) -> int:
    """Parameters of ``modules`` together, each tensor counted once (tied weights, modules shared between parts).
    ``local``: the elements this rank holds, a DTensor's local tensor (its shard under FSDP2 or TP, the whole
    tensor where it is replicated)."""
    unique = {id(p): p for module in modules for p in module.parameters()}.values()
    return sum(p.to_local().numel() if local and hasattr(p, "to_local") else p.numel() for p in unique)


def transformer_block_params(m: ModelShape) -> tuple[int, int]:
    """(matrix parameters of one Llama-style block: q, k, v, o and a 3-matrix MLP; its two norms' parameters)."""
    q, kv = m.n_heads * m.head_dim, m.kv_heads * m.head_dim
    return m.dim * q + 2 * m.dim * kv + q * m.dim + 3 * m.dim * m.hidden_dim, 2 * m.dim


def transformer_edge_params(m: ModelShape, *, tied: bool) -> tuple[tuple[int, int], tuple[int, int]]:
    """Parameters outside the blocks as ((TP-sharded, replicated) on the first stage, the same on the last): the
    token embedding; the output head (none when tied to the embedding) and the final norm."""
    embed = m.vocab_size * m.dim
    return (embed, 0), (0 if tied else embed, m.dim)


def transformer_flops_per_token(m: ModelShape) -> float:
    """Training FLOPs per token: 6 N + 12 L d T (PaLM appendix B; nanoGPT's estimate_mfu).

    N counts the matmul weights (blocks plus the output head, not the embedding lookup), and 12 L d T is the
    attention score and value products over a context of T, forward and backward.
    """
    mats, _ = transformer_block_params(m)
    n_matmul = m.n_layers * mats + m.dim * m.vocab_size
    return 6.0 * n_matmul + 12.0 * m.n_layers * m.dim * m.seq_len


def transformer_tp_checks(m: ModelShape) -> list[tuple[str, int]]:
    """(option, size) pairs a tensor-parallel degree must divide for a Megatron-style transformer plan."""
    return [("model.n_heads", m.n_heads), ("model.n_kv_heads (key/value heads)", m.kv_heads),
            ("model.ffn_dim (MLP width)", m.hidden_dim), ("model.vocab_size", m.vocab_size)]


def _default_init(model: nn.Module, device: torch.device | None) -> None:
    """``model.init_weights(buffer_device=...)`` when the model has it, else every module's reset_parameters()."""
    if hasattr(model, "init_weights"):
        model.init_weights(buffer_device=device)
        return
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()


@dataclass(frozen=True, kw_only=True)
class ModelStructure:
    """Where ``meshrun.parallel`` finds the parts of a built model and how it computes its loss; every field has a
    default, so a built model with its blocks in ``layers`` needs none (see the module docstring). Fields are given
    by keyword."""

    blocks: str = "layers"
    """Attribute (or dotted path) of the repeated blocks: an nn.ModuleDict keyed by layer index, or an
    nn.ModuleList (a pipeline stage sets the other stages' entries to None: ``forward`` must skip them); '' when
    the model has none."""
    first_stage: tuple[str, ...] = ()
    """Modules only the first pipeline stage keeps (e.g. the token embedding)."""
    last_stage: tuple[str, ...] = ()
    """Modules only the last pipeline stage keeps (e.g. final norm and output head)."""
    tp_plan: Callable[..., None] | Mapping[str, Any] | None = None
    """Tensor-parallel plan (dict of module globs to styles, or a function); None: the model has no TP."""
    tie_weights: Callable[[nn.Module], None] | None = None
    """Re-share tied parameters after to_empty / TP (None when the model ties nothing)."""
    sequence_buffers: Callable[[nn.Module], list[tuple[torch.Tensor, int]]] | None = None
    """model -> [(buffer, sequence dim)]: what context parallelism shards with the tokens (RoPE tables; [] for
    none); None: the model does not support context parallelism."""
    hidden_states: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None
    """(model, tokens (B, T)) -> the output head's input (B, T, C), for train.loss=chunked, which applies the head
    itself chunk by chunk; None: the model does not support the chunked loss."""
    head_weight: Callable[[nn.Module], torch.Tensor] | None = None
    """model -> the output head's weight (V, C) (a head without bias), for train.loss=chunked."""
    aux_loss: Callable[[nn.Module], torch.Tensor] | None = None
    """model -> an auxiliary loss term of the forward just run (0-d, already weighted: an MoE router's
    load-balancing loss), added to each micro-batch's mean token loss in the gradients; the logged loss stays the
    cross-entropy. None: no auxiliary term."""

    def model_blocks(self, model: nn.Module) -> nn.Module:
        """The container of the repeated blocks of ``model`` or of one of its pipeline stages (``blocks`` may be a
        dotted path such as ``model.layers``)."""
        return model.get_submodule(self.blocks)

    def block_modules(self, model: nn.Module) -> list[nn.Module]:
        """The repeated blocks themselves, in order (from a ModuleDict or a ModuleList); none when ``blocks`` is ''.
        A pipeline stage's ModuleList holds None for the blocks of other stages: those are left out."""
        if not self.blocks:
            return []
        container = self.model_blocks(model)
        found = container.values() if isinstance(container, nn.ModuleDict) else container
        return [block for block in found if block is not None]


@dataclass(frozen=True, kw_only=True)
class ModelSpec(ModelStructure):
    """One architecture meshrun can build and parallelise: its :class:`ModelStructure` plus how to build, initialise,
    size and count it; see the module docstring for each field. Fields are given by keyword."""

    arch: str
    """The name ``--model.arch`` selects."""
    build: Callable[[ModelShape], nn.Module]
    """Whole model from its shape (called on the meta device)."""
    sizes: Mapping[str, ModelShape]
    """Named sizes ``--model.name`` selects; ``[model]`` fields other than 0 override them."""
    init_weights: Callable[[nn.Module, Any], None] = _default_init
    """(model or pipeline stage, device) -> None: initialise every parameter and buffer in place."""
    block_params: Callable[[ModelShape], tuple[int, int]] = transformer_block_params
    """(matrix, norm) parameters of one block: the planner's memory and traffic formulas."""
    edge_params: Callable[..., tuple[tuple[int, int], tuple[int, int]]] = transformer_edge_params
    """(shape, *, tied) -> ((TP-sharded, replicated) parameters of the first stage outside the blocks, the same for
    the last stage): the planner's formulas."""
    flops_per_token: Callable[[ModelShape], float] = transformer_flops_per_token
    """Training FLOPs per token (the trainer's MFU)."""
    tp_checks: Callable[[ModelShape], list[tuple[str, int]]] = transformer_tp_checks
    """Sizes a tensor-parallel degree must divide, as (option, size)."""
    validate: Callable[[ModelShape, Any], None] | None = None
    """(shape, ParallelDims) -> None: further checks for a layout; raise ConfigError naming the option."""

    def count_params(self, shape: ModelShape) -> int:
        """Unique parameters of the whole model, counted on the meta device (no memory)."""
        import torch

        with torch.device("meta"):
            model = self.build(shape)
        return count_unique_params([model])


_REGISTRY: dict[str, ModelSpec] = {}


def register_model(spec: ModelSpec, *, replace: bool = False) -> ModelSpec:
    """Make ``spec`` selectable as ``--model.arch=spec.arch``; refuses to replace another spec silently."""
    if spec.arch in _REGISTRY and _REGISTRY[spec.arch] is not spec and not replace:
        raise ValueError(f"model.arch={spec.arch!r} is already registered; pick another name or pass replace=True")
    _REGISTRY[spec.arch] = spec
    return spec


def registered_models() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def get_model_spec(arch: str) -> ModelSpec:
    """The spec registered as ``arch``; ``module:name`` imports ``module`` (which registers it) first.

    Raises ValueError naming model.arch and the registered names."""
    _load_builtin()
    if arch not in _REGISTRY and ":" in arch:
        module, _, name = arch.partition(":")
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ValueError(f"model.arch={arch!r}: cannot import {module!r} ({exc}); put it on PYTHONPATH") from None
        if name in _REGISTRY:
            return _REGISTRY[name]
        arch = name
    if arch not in _REGISTRY:
        raise ValueError(f"model.arch={arch!r} is not a registered model; registered: {', '.join(sorted(_REGISTRY))}."
                         " Register yours with meshrun.register_model(ModelSpec(...)), or give module:name")
    return _REGISTRY[arch]


def _load_builtin() -> None:
    """Import every ``meshrun/models/*_spec.py`` (each registers its built-in model, e.g. gpt_spec -> "gpt")."""
    import pkgutil

    import meshrun.models

    for module in pkgutil.iter_modules(meshrun.models.__path__):
        if module.name.endswith("_spec"):
            importlib.import_module(f"meshrun.models.{module.name}")
