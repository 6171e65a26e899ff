"""Linear layers' weights held as compute-dtype copies for a step (``parallel.pp_cast_once``, ``train.weight_copies``).

Under bf16 autocast every linear layer casts its fp32 weight to bf16 each time it runs, and autograd casts the
weight's gradient back to fp32 and adds it into ``.grad``. A pipeline stage runs each of its blocks once per
micro-batch, so with 8 micro-batches a step casts every weight 8 times (compiled blocks cast inside the graph,
where autocast's cast cache does not apply) and adds 8 fp32 gradients. Profiles of the 1b model on 2 H100s put that
memory traffic at about 37 ms of a 285 ms step on the first stage (docs/performance.md).

With :class:`StepWeights`, each linear layer of a stage gets a copy of its weight (and bias) in the compute dtype,
refreshed from the fp32 parameter once per step. For the length of a step the layer holds the copy, so autocast
finds it in bf16 and casts nothing, and a hook adds each micro-batch's bf16 gradient straight into the fp32
parameter's ``.grad`` (``grad.to(fp32)`` for the first, ``add_`` for the others), then drops it. The arithmetic is
autocast's: the same bf16 values in the matmuls and the same fp32 sums of the gradients in the same order, so losses
and gradients are bitwise those without it (tests/test_step_weights.py). Outside a step the layers hold their fp32
parameters again: the optimizer, gradient clipping, checkpoints and state dicts never see the copies.

The copies are persistent tensors updated in place, so CUDA graphs, which take parameters as fixed inputs, keep
replaying the same addresses. Other parameters (norms, embeddings) are left alone: autocast runs those ops in fp32.

A copy is cast again only where its fp32 parameter changed since the copy was last made: each parameter's version
counter (which every in-place change bumps: torch's optimizers, a checkpoint loaded) and address are compared with
those seen then. meshrun's Triton AdamW writes each copy as it updates the parameter (parallel/triton_adamw.py, 2
bytes written where a cast reads 4 and writes 2) and says so (:meth:`StepWeights.written`), so then no step casts.

In one process (``train.weight_copies``, measured on the 1b model on one H200: 1.026x autocast's casts) a step of
one micro-batch can also leave each copy's gradient in bf16 (``grads_in_dtype``; torch 2.10 and newer let an fp32
parameter hold it, ``Tensor.grad_dtype``): no cast of it to fp32, and the optimizer reads 2 bytes of it, not 4.
Steps of several micro-batches add their gradients in fp32 as above. A weight that an embedding shares (tied
embeddings) gets no copy: its other use would add an fp32 gradient to the copy's. (A copy of a tied table that the
lookup reads too, where the stream between blocks is bf16, was tried: 1.001x in one process and 0.985x under DDP on
2 H200s, whose bucket of the layers' bf16 gradients then waited for the table's, complete only at the end of
backward; docs/benchmarks.md, round 32.)

Under DDP (``reduced_by_ddp``) DDP is built while the layers hold the copies (:meth:`registered_by`), so the copies
are its parameters: their gradients land in bf16 buckets, which it divides by the world size and all-reduces as it
does fp32 ones, half the bytes, each element's sum rounded to bf16 (once on 2 ranks; on 8, as NCCL's ring adds the
ranks' shares, up to 7 times). No hook takes a copy's gradient as it arrives (DDP's reducer reads it after the hook);
when a backward pass has ended, and with it DDP's all-reduce, :meth:`hand_over` gives each averaged gradient to its
fp32 parameter. A step of several micro-batches (a resume that keeps the checkpoint's global batch on fewer ranks
re-derives accumulation) cannot skip the all-reduce until the last, as DDP's ``no_sync`` does, for DDP would add the
micro-batches in bf16: the engine all-reduces each one and :meth:`hand_over` adds them in fp32.

Adding a bf16 gradient into an fp32 one runs, in eager torch on a GPU, in an unvectorised mixed-dtype kernel: on 2
H200s (1b, PP 2, 8 micro-batches) 14.7 ms of a 254 ms step on the first stage. Where the blocks are compiled on a
GPU, the hook instead keeps each micro-batch's gradients until that backward pass ends and then adds them all in one
compiled call (:func:`compiled_adder`: inductor's vectorised kernels, launched by one wrapper). The sums are the same
fp32 additions in the same order per tensor, so the values are bitwise those of the eager adds.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from typing import Callable, Iterator, Sequence

import torch
from torch import nn

COPIED_MODULES: tuple[type[nn.Module], ...] = (nn.Linear,)
"""The modules whose parameters get copies: those autocast casts to bf16 on every call."""

GradAdder = Callable[[list[torch.Tensor], list[torch.Tensor]], None]
"""Adds each tensor of the second list into the one at the same place in the first, in place."""


def add_all(accumulators: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """``accumulators[i] += grads[i]`` for every i, in place (fp32 += bf16)."""
    torch._foreach_add_(accumulators, grads)


def compiled_adder() -> GradAdder:
    """:func:`add_all` compiled: one graph per list of shapes (one per pipeline stage), each addition a vectorised
    kernel, all launched by one call. (A model whose layers do not all get a gradient in every micro-batch gives
    lists of varying shapes; past dynamo's recompile limit those run eagerly, with the same sums.)"""
    return torch.compile(add_all, dynamic=False)


def grad_adder(*, compiled: bool, device: torch.device) -> GradAdder | None:
    """How :class:`StepWeights` adds a micro-batch's gradients: compiled, after each backward pass, where the model
    is compiled on a GPU; None (each one as it arrives, eagerly) elsewhere, where a compilation would cost more
    than the eager adds (CPU)."""
    return compiled_adder() if compiled and device.type == "cuda" else None


class StepWeights:
    """The compute-dtype copies of ``parts``' linear layers' parameters, and the swap that puts them in place.

    ``add``: how each micro-batch's gradients reach the fp32 ones after the first (the first is cast): None adds
    each as its hook fires; a :data:`GradAdder` gets them all at the end of that backward pass, in one call."""

    def __init__(self, parts: Sequence[nn.Module], dtype: torch.dtype, *, add: GradAdder | None = None,
                 grads_in_dtype: bool = False, reduced_by_ddp: bool = False):
        self.dtype = dtype
        self.reduced_by_ddp = reduced_by_ddp
        """DDP holds the copies as its parameters (:meth:`registered_by`): their gradients land in its bf16
        buckets, which it all-reduces, and :meth:`held` hands them to the fp32 parameters as the step ends."""
        self.add = add
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        """(fp32 gradient, this micro-batch's gradient) to add when the backward pass running now ends."""
        self.slots: list[tuple[nn.Module, str, nn.Parameter, nn.Parameter]] = []
        """(module, name, fp32 parameter, copy) for each place a copied parameter is held."""
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        """(fp32 parameter, copy), once each."""
        self.copies: dict[int, nn.Parameter] = {}
        """id(fp32 parameter) -> its copy. A weight two linear layers share gets one copy, which both hold."""
        self.synced: dict[int, tuple[int, int]] = {}
        """id(fp32 parameter) -> (its version counter, its address) when its copy last equalled it."""
        self.grads_in_dtype = grads_in_dtype and hasattr(torch.Tensor, "grad_dtype")
        """A step of one micro-batch may leave each gradient in the copy's dtype (:meth:`held`): torch 2.10 and
        newer let an fp32 parameter hold it (``Tensor.grad_dtype``)."""
        self.keep_grads = False
        """This step's gradients stay in the copies' dtype (one micro-batch, ``grads_in_dtype``)."""
        self.casts = 0
        """Copies :meth:`refresh` has cast from their fp32 parameters (tests read it)."""
        elsewhere = {id(p) for part in parts for module in part.modules() if not isinstance(module, COPIED_MODULES)
                     for p in module.parameters(recurse=False)}
        for part in parts:
            for module in part.modules():
                if not isinstance(module, COPIED_MODULES):
                    continue
                for name, param in module.named_parameters(recurse=False):
                    if not param.is_floating_point() or param.dtype == dtype or id(param) in elsewhere:
                        continue  # a weight an embedding shares reaches autocast's cast there anyway
                    if id(param) not in self.copies:
                        copy = nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad)
                        if param.requires_grad:
                            if not reduced_by_ddp:  # under DDP its reducer owns the copy's gradient until it ends
                                copy.register_post_accumulate_grad_hook(partial(self._handed_on, param))
                            if self.grads_in_dtype:
                                param.grad_dtype = None  # it may hold the copy's bf16 gradient
                        self.copies[id(param)] = copy
                        self.pairs.append((param, copy))
                    self.slots.append((module, name, param, self.copies[id(param)]))

    def __len__(self) -> int:
        return len(self.slots)

    def _handed_on(self, master: torch.Tensor, copy: torch.Tensor) -> None:
        """The copy's post-accumulate hook: its gradient (this micro-batch's) into the fp32 parameter's, then dropped
        from the copy."""
        grad, copy.grad = copy.grad, None
        if master.grad is None:
            master.grad = grad if self.keep_grads else grad.to(master.dtype)
        elif self.add is None:
            master.grad.add_(grad)
        else:
            if not self.pending:  # the first of this backward pass: add them all when it ends
                torch.autograd.Variable._execution_engine.queue_callback(self._flush)
            self.pending.append((master.grad, grad))

    def _flush(self) -> None:
        accumulators, grads = [a for a, _ in self.pending], [g for _, g in self.pending]
        self.pending.clear()
        self.add(accumulators, grads)

    def describe(self, *, written: bool, micro_batches: int) -> str:
        """For the start-up speed line: who makes the copies (``written``: the optimizer's kernel), and whether a
        step of ``micro_batches`` keeps the gradients bf16."""
        text = "bf16 weight copies " + ("written by the AdamW kernel" if written else "cast once per step")
        text += " and bf16 weight gradients" if self.grads_in_dtype and micro_batches == 1 else ""
        return text + (", all-reduced in bf16 (DDP)" if self.reduced_by_ddp else "")

    def copy_of(self, param: torch.Tensor) -> torch.Tensor | None:
        """``param``'s copy, or None where it has none."""
        return self.copies.get(id(param))

    def written(self, params: Sequence[torch.Tensor]) -> None:
        """The optimizer has written these parameters' copies as it updated them (parallel/triton_adamw.py) and
        counted the update in their version counters: the next :meth:`held` need not copy them again."""
        for param in params:
            if id(param) in self.copies:
                self.synced[id(param)] = (param._version, param.data_ptr())

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the fp32 parameters into the copies, in place: those changed since their copy was last made or
        written (by an optimizer step that did not write it, a checkpoint loaded, any in-place change, which
        counts in the parameter's version counter)."""
        for param, copy in self.pairs:
            now = (param._version, param.data_ptr())
            if self.synced.get(id(param)) != now:
                copy.copy_(param)
                self.synced[id(param)] = now
                self.casts += 1

    @contextmanager
    def held(self, *, micro_batches: int = 0) -> Iterator[None]:
        """Refresh the copies and let the layers hold them until the block ends (one optimizer step's forwards and
        backwards, or an evaluation). A step of ``micro_batches`` 1 leaves each copied weight's gradient in the
        compute dtype where ``grads_in_dtype`` allows it: no cast of it to fp32, and the optimizer reads 2 bytes
        of it instead of 4. Several micro-batches add their gradients in fp32."""
        self.refresh()
        self.pending.clear()  # left by a backward pass that raised before it ended
        self.keep_grads = self.grads_in_dtype and micro_batches == 1
        with self.registered_by():
            yield
            if self.reduced_by_ddp:
                self.hand_over()

    def hand_over(self) -> None:
        """Under DDP, once a backward pass has ended (and with it DDP's all-reduce of each bucket): each copy's
        averaged gradient becomes its fp32 parameter's, in the copy's dtype where the step keeps it (``keep_grads``:
        one micro-batch), else cast to fp32, or added in fp32 to the earlier micro-batches' (the engine all-reduces
        each micro-batch then: DDP would add them in the copies' bf16 under ``no_sync``). Nothing to do where no
        copy holds a gradient (called again at the step's end)."""
        for master, copy in self.pairs:
            if copy.grad is None:
                continue
            grad, copy.grad = copy.grad, None
            if master.grad is None:
                master.grad = grad if self.keep_grads else grad.to(master.dtype)
            else:
                master.grad.add_(grad)

    @contextmanager
    def registered_by(self) -> Iterator[None]:
        """The layers hold the copies until the block ends, without a refresh or a step's settings (:meth:`held`
        adds those): DDP built inside the block takes the parameters it finds then (the copies) for its buckets and
        hooks."""
        for module, name, _, copy in self.slots:
            module._parameters[name] = copy
        try:
            yield
        finally:
            for module, name, param, _ in self.slots:
                module._parameters[name] = param
