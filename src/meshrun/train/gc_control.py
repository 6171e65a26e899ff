"""Python's garbage collector off the training step's critical path.

A generation-2 collection walks every live Python object; in a process that holds a compiled model, its guards and
the autograd graph's bookkeeping that is tens of milliseconds at a random step, which shows up as a slow step on one
rank (and, in synchronous training, on every rank waiting for it). torchtitan disables automatic collection and
collects every N steps; this does the same, and freezes what is alive after the first step (the model, the
compiled code, the optimizer) so that the periodic collections do not scan it again.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("meshrun")


class StepCollector:
    """Owns the collector for a training loop: ``step(n)`` after each optimizer step, ``close()`` at the end.

    ``every`` = 0 leaves Python's automatic collection untouched. ``close`` restores what it found, so an
    in-process trainer (tests, notebooks) leaves the interpreter as it was.
    """

    def __init__(self, every: int):
        self.every = every
        self._was_enabled = gc.isenabled()
        self._frozen = False
        if every:
            gc.disable()

    def step(self, step: int) -> None:
        """After optimizer step ``step``: freeze the survivors of the first step, then collect every N steps."""
        if not self.every:
            return
        if not self._frozen:
            gc.collect()
            gc.freeze()  # model, compiled code, optimizer state objects: permanent, never scanned again
            self._frozen = True
        elif step % self.every == 0:
            start = time.perf_counter()
            gc.collect(1)  # the young generations: what the steps since the last collection left behind
            log.debug("gc at step %d: %.1f ms", step, 1e3 * (time.perf_counter() - start))

    def close(self) -> None:
        if not self.every:
            return
        if self._frozen:
            gc.unfreeze()
        if self._was_enabled:
            gc.enable()
