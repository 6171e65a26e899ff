"""A running job's health wiring, written once for ``meshrun train`` (the Trainer) and a user's own loop (Session):
the hang watchdog, the straggler detector and the timer of each rank's own work.

The two callers differ only in what they feed it: the trainer gathers its per-rank timing rows itself and hands the
table to :meth:`StragglerDetector.observe_table`; Session calls :meth:`StragglerDetector.observe` every ``every``
heartbeats.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from meshrun.env import ProcessPlacement
from meshrun.watch.hang import HangWatchdog
from meshrun.watch.stragglers import RankInfo, StragglerDetector, StragglerReport, WorkTimer


def stack_file(stack_dir: str | Path | None, rank: int) -> Path | None:
    """Where a hang report writes this rank's Python stacks: ``<stack_dir>/stacks_rank_<rank>.txt``."""
    return Path(stack_dir) / f"stacks_rank_{rank:05d}.txt" if stack_dir else None


class JobHealth:
    """The hang watchdog (started by :meth:`start_watchdog`), the straggler detector (None in one process or with
    ``straggler_threshold=0``) and the work timer over ``parts``' forward passes, for one rank of a running job.

    Construction is a collective when the detector is on and ``ranks`` is not given (it gathers host names)."""

    def __init__(self, *, env: ProcessPlacement, device: torch.device, parts: list[torch.nn.Module],
                 straggler_threshold: float, gemm_check: bool = False, ranks: list[RankInfo] | None = None):
        self.env = env
        self.timer = WorkTimer(parts, device)
        self.stragglers: StragglerDetector | None = (
            StragglerDetector(env=env, threshold=straggler_threshold, min_gap_s=0.01, gemm_check=gemm_check,
                              compute_device=device, ranks=ranks)
            if env.is_distributed and straggler_threshold else None)
        self.watchdog: HangWatchdog | None = None

    def start_watchdog(self, *, timeout_s: float, stack_dir: str | Path | None = None,
                       log: Callable[[str], None] | None = None, on_hang: Callable[[str], None] | None = None,
                       end_job: bool = False) -> None:
        """Start the watchdog thread (no-op in one process or with ``timeout_s=0``); :meth:`stop` ends it."""
        if self.env.is_distributed and timeout_s:
            self.watchdog = HangWatchdog(env=self.env, timeout_s=timeout_s,
                                         stack_file=stack_file(stack_dir, self.env.rank), log=log, on_hang=on_hang,
                                         end_job=end_job).start()

    def beat(self, step: int, phase: str, timeout_s: float | None = None) -> None:
        """This rank made progress (cheap: no I/O); ``timeout_s`` overrides the limit until the next beat."""
        if self.watchdog is not None:
            self.watchdog.beat(step, phase, timeout_s=timeout_s)

    def notice(self, step: int, report: StragglerReport | None) -> str | None:
        """The straggler line to print now: a report is said again only when its verdict changes."""
        return self.stragglers.notices.to_say(step, report) if self.stragglers is not None else None

    def stop(self) -> None:
        """Stop the watchdog; call before the process group (and its store) goes away. Idempotent."""
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
