"""Pipeline parallelism with ``torch.distributed.pipelining``: stage splitting, schedules and the PipelineEngine.

Splitting: the model's layers are cut into ``pp x virtual`` contiguous stages, by estimated cost or by layer count
(``parallel.pp_balance``, see meshrun.parallel.stage_cut). Each stage is a copy of the full (meta-device) model with the blocks it
does not own deleted; the blocks (the ModelSpec's ``blocks``, e.g. ``layers``) are a ModuleDict keyed by the global
layer index, so a stage's parameter names are the same as in the whole model ("<blocks>.7.<...>.weight") and
checkpoints line up across layouts. The first stage keeps the spec's ``first_stage`` modules (the embedding), the
last its ``last_stage`` modules (e.g. final norm and output head); elsewhere they are None. Tied embeddings cannot be
shared between two stages, so pipeline layouts untie them (see :func:`effective_model_config`).

Stages per rank: GPipe and 1F1B give each pp rank one stage; Interleaved1F1B, InterleavedZeroBubble and LoopedBFS
give rank r the stages r, r + pp, r + 2 pp, ... (``parallel.pp_virtual_stages`` of them). The V-shaped schedules
(ZBVZeroBubble, DualPipeV) are not offered: see docs/parallelism.md.

Batches: ``forward_backward`` concatenates this dp rank's grad-accumulation micro-batches into one batch of
``micro_batch x grad_accum`` samples, and the schedule splits it into ``parallel.pp_microbatches`` pipeline
micro-batches. Each pipeline micro-batch's loss is its token-loss sum divided by the tokens of the whole step, so
the accumulated gradient is that of the mean loss over this rank's samples (and, after the dp reduction, over
the global batch), exactly as without pipelining.
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
from contextlib import nullcontext
from dataclasses import replace
from typing import TYPE_CHECKING, Sequence

import torch
import torch.distributed as dist
from torch import nn

from meshrun.config import ConfigError, PipelineSchedule
from meshrun.models.shape import ModelShape
from meshrun.parallel.engine import Batch, autocast, count_tensor, new_replay_generation, token_loss_sum
from meshrun.parallel.grad_norm import clip_grad_norm
from meshrun.parallel.step_weights import StepWeights

if TYPE_CHECKING:
    from meshrun.models.spec import ModelStructure


def bubble_fraction(stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Idle share of a pipeline step: (p - 1) / m, or (p - 1) / (v m) with v interleaved stages per rank.

    (Megatron-LM, Narayanan et al. 2021, section 2.2.) 4 stages, 32 micro-batches: 3 / 32 = 9.4 %.
    """
    return (stages - 1) / (virtual_stages * microbatches)


def effective_model_config(cfg: ModelShape, *, pp: int) -> ModelShape:
    """The model config a layout actually trains: with pp > 1, embeddings are untied (the first stage holds the
    embedding, the last the output head, and tying them across stages would need an extra all-reduce)."""
    return replace(cfg, tie_embeddings=False) if pp > 1 and cfg.tie_embeddings else cfg


def layer_ranges(n_layers: int, n_stages: int) -> list[range]:
    """Contiguous layer indices of each stage; sizes differ by at most one, extra layers on the earlier stages."""
    base, extra = divmod(n_layers, n_stages)
    ranges, start = [], 0
    for stage in range(n_stages):
        size = base + (1 if stage < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def stage_ids(pp_rank: int, *, pp: int, virtual_stages: int) -> list[int]:
    """Stages run by pipeline rank ``pp_rank`` (looped placement for interleaved schedules)."""
    return [pp_rank + v * pp for v in range(virtual_stages)]


def split_stage(model: nn.Module, stage: int, n_stages: int, *, spec: ModelStructure,
                ranges: Sequence[range] | None = None) -> nn.Module:
    """A copy of ``model`` (best on the meta device) holding only ``stage``'s blocks, with the original names.

    Blocks in an nn.ModuleDict are deleted; in an nn.ModuleList they become None (``forward`` must skip them).

    ``spec`` (the model's ModelSpec, or Session's ModelStructure) names the blocks and the first/last-stage
    modules; ``ranges`` are the block indices of every stage (meshrun.parallel.stage_cut; an even cut when None)."""
    part = copy.deepcopy(model)
    blocks = spec.model_blocks(part)
    owned = {str(i) for i in (ranges if ranges is not None else layer_ranges(len(blocks), n_stages))[stage]}
    for name in list(blocks._modules):
        if name in owned:
            continue
        if isinstance(blocks, nn.ModuleList):
            blocks[int(name)] = None  # the slot stays, so the other blocks keep their indices (and names)
        else:
            del blocks[name]
    dropped = (spec.first_stage if stage != 0 else ()) + (spec.last_stage if stage != n_stages - 1 else ())
    for name in dropped:  # a dotted name ("model.norm") is set on its parent module
        parent, _, attr = name.rpartition(".")
        setattr(part.get_submodule(parent), attr, None)
    return part


def build_schedule(stages: list, *, schedule: PipelineSchedule, microbatches: int, loss_fn, forward_only: bool = False):
    """The torch.distributed.pipelining schedule object for ``stages`` (this rank's stages)."""
    from torch.distributed import pipelining as pl

    if forward_only:  # evaluation: any micro-batch count, no backward
        cls = pl.ScheduleGPipe if len(stages) == 1 else pl.ScheduleLoopedBFS
    else:
        cls = {"gpipe": pl.ScheduleGPipe, "1f1b": pl.Schedule1F1B, "interleaved1f1b": pl.ScheduleInterleaved1F1B,
               "interleavedzb": pl.ScheduleInterleavedZeroBubble, "loopedbfs": pl.ScheduleLoopedBFS}[schedule]
        if schedule == "interleavedzb":
            check_split_backward(stages)
    single = cls in (pl.ScheduleGPipe, pl.Schedule1F1B)
    # loss_fn returns sum / tokens-of-the-step, so the schedule must not divide gradients by the micro-batch count
    # (torch versions before the scale_grads argument never divided them)
    extra = {"scale_grads": False} if "scale_grads" in inspect.signature(cls.__init__).parameters else {}
    legacy_forward_only = forward_only and not hasattr(cls, "eval")
    if legacy_forward_only:  # torch < 2.9 has no eval(): without loss_fn, step() runs forward only
        loss_fn = None
    built = cls(stages[0] if single else stages, n_microbatches=microbatches, loss_fn=loss_fn, **extra)
    if legacy_forward_only and hasattr(built, "pipeline_order"):
        # several local stages: the looped schedule has backward actions even without a loss; keep its forward
        # actions only (no-op slots too, so the send/receive order stays the same)
        built.pipeline_order = {rank: [a for a in actions if a is None or a.computation_type.name == "FORWARD"]
                                for rank, actions in built.pipeline_order.items()}
    return built


EAGER_WEIGHTS = "_meshrun_eager_weights"
"""Set on a block whose weights apply.keep_weights_eager left out of its compiled graphs: "linears" (only the linear
layers' weights) or "all"."""


@functools.cache
def split_backward_routes_each_output() -> bool:
    """Whether this torch's zero-bubble weight pass routes the saved gradients of a node with several outputs to
    each output. A compiled graph's backward is such a node. torch 2.8 refused it (an assertion), later versions
    summed the gradients into the first output (wrong weight gradients, pytorch#170277), and the fix (pytorch
    #175705) routes each. Probed on a two-output function against plain autograd, on CPU, once per process."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    class TwoOutputs(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, w):
            ctx.save_for_backward(a, w)
            return a * w, a * w * 2

        @staticmethod
        def backward(ctx, g1, g2):
            a, w = ctx.saved_tensors
            total = g1 + 2 * g2
            return total * w, (total * a).sum(0)

    def loss_of(x, w):
        first, second = TwoOutputs.apply(x, w)
        return (first * torch.tensor([1.0, -1.0])).sum() + (second * torch.tensor([3.0, 0.5])).sum()

    w = nn.Parameter(torch.tensor([0.5, -2.0]))
    x = torch.tensor([[1.0, 2.0], [3.0, -1.0]], requires_grad=True)
    expected = torch.autograd.grad(loss_of(x, w), w)[0]
    try:
        with torch.enable_grad():
            _, groups = stage_backward_input([loss_of(x, w)], None, [x], iter([w]))
            stage_backward_weight(iter([w]), groups)
    except (AssertionError, RuntimeError, TypeError):  # TypeError: a torch whose split functions changed shape
        return False
    return w.grad is not None and torch.allclose(w.grad, expected)


def check_split_backward(stages: list) -> None:
    """Zero-bubble schedules run each backward as two passes (input gradients now, weight gradients later), which
    torch does not support for compiled modules; it only detects torch.compile(module) wrappers, not blocks
    compiled in place (``module.compile()``, as meshrun does), so this checks those too. Blocks compiled with their
    weights left out of the graphs (apply.keep_weights_eager, as parallelize does for these schedules) can split:
    their weights' gradients come from eager matmuls, or with "linears" from graphs that this torch's weight pass
    can run again (:func:`split_backward_routes_each_output`)."""
    for stage in stages:
        modules = list(stage.submod.modules())
        if (any(getattr(m, EAGER_WEIGHTS, "") == "linears" for m in modules)
                and not split_backward_routes_each_output()):
            raise ConfigError(f"parallel.pp_schedule=interleavedzb: blocks compiled with only their linear layers "
                              f"eager need torch's zero-bubble weight pass to handle a compiled graph's several "
                              f"outputs, which torch {torch.__version__} does not (pytorch#170277, fixed in "
                              "pytorch#175705); compile them with every weight eager "
                              "(apply.keep_weights_eager(block, only_linears=False)), or set --train.compile=false")
        if any(getattr(m, "_compiled_call_impl", None) is not None and not getattr(m, EAGER_WEIGHTS, "")
               for m in modules):
            raise ConfigError("parallel.pp_schedule=interleavedzb splits each backward into input and weight "
                              "gradients, which torch does not support for compiled blocks; set --train.compile=false "
                              "or use --parallel.pp_schedule=interleaved1f1b")


class PipelineEngine:
    """Runs one optimizer step as one pipeline schedule step; see the module docstring for the batch handling."""

    def __init__(self, parts: list[nn.Module], ids: list[int], *, n_stages: int, schedule: str, microbatches: int,
                 device: torch.device, pp_group: dist.ProcessGroup, dp_rank: int, dp_size: int, tp_rank: int,
                 autocast_dtype: torch.dtype | None, loss_fn=token_loss_sum, cuda_graphs: bool = False,
                 step_weights: StepWeights | None = None):
        from torch.distributed.pipelining import PipelineStage

        self.cuda_graphs = cuda_graphs
        """The blocks are compiled with CUDA graphs: each optimizer step starts a new replay generation, so that
        every micro-batch of a step replays graphs of its own (a replay of the same graph would overwrite the
        activations a later backward needs, and the first micro-batch's gradients: pytorch#169545)."""
        self.model_parts = parts
        self.timed_modules = parts  # a stage's forward holds no collective: the schedule sends and receives
        self.stage_ids = ids
        self.n_stages = n_stages
        self.schedule_name = schedule
        self.microbatches = microbatches
        self.device = device
        self.pp_group = pp_group
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.is_first = 0 in ids
        self.is_last = n_stages - 1 in ids
        self.reports_loss = self.is_last and tp_rank == 0
        """True on the one rank per data-parallel replica that returns non-zero loss sums."""
        self.autocast_dtype = autocast_dtype
        self.token_loss = loss_fn
        self.step_weights = step_weights
        """parallel.pp_cast_once: the linear layers hold compute-dtype copies of their weights during each step."""
        stages = [PipelineStage(part, i, n_stages, device, group=pp_group) for part, i in zip(parts, ids)]
        self.schedule = build_schedule(stages, schedule=schedule, microbatches=microbatches, loss_fn=self._loss_fn)
        self._eval_schedules: dict[int, object] = {}
        self._scale = 1
        self._stepped = False
        """A training step has run: its stages have inferred their shapes."""

    def _loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # A pipeline micro-batch's token-loss sum over the tokens of the whole step. (Not recorded here: torch may
        # also call this for shape inference on the first step; the schedule's `losses` list is the true record.)
        return self.token_loss(logits, targets) / self._scale

    def forward_backward(self, batches: Sequence[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
        """Collective: every rank of the pipeline group must call this with the same number of samples."""
        inputs = torch.cat([b[0] for b in batches])  # (A*B, T)
        targets = torch.cat([b[1] for b in batches])
        self._scale = targets.numel()
        args = (inputs,) if self.is_first else ()
        losses: list[torch.Tensor] = []
        new_replay_generation(self.cuda_graphs)
        # The first step's stages infer their output shapes with a forward under torch.no_grad(), inside this
        # autocast. In torch 2.8 autocast's cache then keeps those weight casts, made without autograd, and the
        # step's real forwards reuse them: the uncompiled linear layers (all of them without compile, the output
        # head with it) got no gradient in the first step. Without the cache for that step every cast is made anew.
        with autocast(self.device.type, self.autocast_dtype, cache=self._stepped), self._weights_held():
            self.schedule.step(*args, target=targets, losses=losses)
        self._stepped = True
        return self._reported(losses, targets.numel())

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward only, through a separate schedule (and stages) sized for the evaluation batch."""
        schedule = self._eval_schedule(inputs.shape[0])
        self._scale = targets.numel()
        new_replay_generation(self.cuda_graphs)
        args = (inputs.contiguous(),) if self.is_first else ()  # stages check strides (torch 2.8: (T+1, 1) slices fail)
        losses: list[torch.Tensor] = []
        with autocast(self.device.type, self.autocast_dtype), self._weights_held():
            if hasattr(schedule, "eval"):
                schedule.eval(*args, target=targets, losses=losses)
            else:  # torch < 2.9: a forward-only schedule without loss_fn (see build_schedule) returns the logits
                logits = schedule.step(*args)
                if self.is_last:
                    losses.append(self._loss_fn(logits, targets))
        return self._reported(losses, targets.numel())

    def _weights_held(self):
        return self.step_weights.held() if self.step_weights is not None else nullcontext()

    def _eval_schedule(self, batch: int):
        # Stages fix their receive buffers' shapes at the first step, so evaluation gets its own stages.
        if batch not in self._eval_schedules:
            from torch.distributed.pipelining import PipelineStage

            stages = [PipelineStage(part, i, self.n_stages, self.device, group=self.pp_group)
                      for part, i in zip(self.model_parts, self.stage_ids)]
            self._eval_schedules[batch] = build_schedule(stages, schedule=self.schedule_name, forward_only=True,
                                                         microbatches=math.gcd(batch, self.microbatches),
                                                         loss_fn=self._loss_fn)
        return self._eval_schedules[batch]

    def _reported(self, losses: list[torch.Tensor], tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss sum, tokens) on the reporting rank, zeros elsewhere. ``losses`` holds the last stage's
        per-micro-batch values of ``_loss_fn`` (sum / tokens of the step)."""
        if not self.reports_loss:
            zero = torch.zeros((), dtype=torch.float32, device=self.device)
            return zero, zero.clone()
        loss_sum = torch.stack([value.detach().float() for value in losses]).sum() * self._scale
        return loss_sum, count_tensor(tokens, self.device)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        params = [p for part in self.model_parts for p in part.parameters()]
        return clip_grad_norm(params, max_norm, pp_group=self.pp_group)
