"""``train.nonfinite``: a step whose gradient norm is NaN or infinite never updates the weights.

Each step the global gradient norm (the one clipping uses, or the same norm computed without clipping) is tested
on the device. With the fused AdamW of a GPU run the optimizer is handed the verdict as ``found_inf`` (the same
hook ``torch.amp.GradScaler`` uses), and its kernel leaves parameters, moments and step count untouched: no host
synchronisation. Elsewhere (CPU, or a non-fused optimizer) the verdict is read on the host and the step is not
called. Either way the guard keeps, on the device, the number of such steps, the first one, and the first step at
which this rank's own loss was not finite. At log steps (where the trainer synchronises anyway) it reports them,
naming the ranks whose loss went bad first, and with ``stop`` ends the run.

Modes: ``skip`` (default) skips the update and warns; ``stop`` skips it and stops the run at the next log step
with an error, before any later checkpoint; ``off`` does no check (the weights take NaN updates).
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

class NonFiniteError(RuntimeError):
    """Raised with train.nonfinite=stop; the message names the step, the ranks and what to change."""


class NonFiniteGuard:
    def __init__(self, mode: str, *, device: torch.device, rank: int, fused_optimizer: bool,
                 hosts: list[str] | None = None):
        """``hosts``: every rank's host name in rank order, when the caller has gathered them already (the
        trainer's start does); otherwise a report gathers them."""
        self.mode, self.rank, self.device, self.fused, self.hosts = mode, rank, device, fused_optimizer, hosts
        zero = torch.zeros((), dtype=torch.int64, device=device)
        self.count, self.first_step, self.first_local_step = zero.clone(), zero.clone(), zero.clone()
        self.reported = 0  # steps already reported

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def allow_step(self, step: int, grad_norm: torch.Tensor, loss_sum: torch.Tensor,
                   optimizer: torch.optim.Optimizer) -> bool:
        """Before ``optimizer.step()`` for ``step`` (counted from 1). False: the caller must not step (host check).
        With a fused optimizer it returns True and the optimizer skips on the device."""
        bad = ~torch.isfinite(grad_norm.detach().float())
        local_bad = ~torch.isfinite(loss_sum.detach().float())
        here = torch.full((), step, dtype=torch.int64, device=self.device)
        self.first_step = torch.where((self.first_step == 0) & bad, here, self.first_step)
        self.first_local_step = torch.where((self.first_local_step == 0) & local_bad, here, self.first_local_step)
        self.count += bad
        if self.fused:
            optimizer.found_inf = bad.float()  # fused AdamW: no update where this is 1, no host sync
            return True
        return not bool(bad)  # note: a host sync, only where the optimizer cannot skip by itself

    def check(self, step: int, world_size: int, *, count: int | None = None, first: int | None = None) -> str | None:
        """At a log step: None when no new non-finite step; else the report (raises NonFiniteError for 'stop').
        ``count`` and ``first``: the guard's counts as the log step read them (``self.count``, ``self.first_step``
        then); read from the device when not given. Collective when something was found: every rank sees the same
        global norm, so all of them enter."""
        count = int(self.count) if count is None else count  # the log step synchronises anyway
        if count == self.reported:
            return None
        new, self.reported = count - self.reported, count
        first = int(self.first_step) if first is None else first
        culprits = self._first_bad_ranks(world_size)
        where = (f"the loss first went non-finite on {culprits}" if culprits else
                 "every rank's loss stayed finite: the gradients overflowed in backward")
        what = (f"step {first}: the gradient norm is not finite (NaN or inf); {where}. {new} step(s) up to step "
                f"{step} did not update the weights ({count} in this run)")
        if self.mode == "stop":
            raise NonFiniteError(
                f"train.nonfinite=stop: {what}. The run stops before saving; the weights are those before step "
                f"{first}. Lower train.lr, keep train.grad_clip on, or set --train.nonfinite=skip to go on")
        return f"{what}; training goes on (train.nonfinite=skip)"

    def _first_bad_ranks(self, world_size: int) -> str:
        """'rank 1 (host h1)' for the ranks whose own loss went non-finite at the earliest step, or ''.
        Collective when distributed: one all_gather of an int per rank (and of host names without ``hosts``)."""
        firsts = {self.rank: int(self.first_local_step)}
        if world_size > 1 and dist.is_initialized():
            parts = [torch.empty(1, dtype=torch.int64, device=self.device) for _ in range(world_size)]
            dist.all_gather(parts, self.first_local_step.reshape(1))  # note: collective, every rank must reach it
            firsts = dict(enumerate(torch.cat(parts).tolist()))
        bad = {rank: first for rank, first in firsts.items() if first > 0}
        if not bad:
            return ""
        hosts = self._hosts(world_size)
        earliest = min(bad.values())
        return ", ".join(f"rank {rank} (host {hosts[rank]})" for rank, first in bad.items()
                         if first == earliest) + f" at step {earliest}"

    def _hosts(self, world_size: int) -> dict[int, str]:
        """Host name by rank: the ones given, else gathered (collective when distributed)."""
        if self.hosts is not None:
            return dict(enumerate(self.hosts))
        if world_size > 1 and dist.is_initialized():
            hosts: list = [None] * world_size
            dist.all_gather_object(hosts, socket.gethostname())  # note: collective, every rank must reach it
            return {rank: str(host) for rank, host in enumerate(hosts)}
        return {self.rank: socket.gethostname()}
