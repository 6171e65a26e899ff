"""SIGTERM as a request to save and stop, rather than an immediate death.

Schedulers and torchrun's agent send SIGTERM before they kill (torchrun forwards it to every worker and waits
30 s by default; SLURM sends it ``--signal``/KillWait seconds ahead). The handler only sets a flag; the trainer
polls it through ``Checkpointer.should_save``, which all-reduces it so that every rank stops at the same step
even when the signal reached only some of them, saves a final checkpoint and exits. A second SIGTERM is
not intercepted: it runs the previous handler (by default: terminate now).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any


class PreemptionFlag:
    """Set by the signal handler; read by the training loop. Safe to read from any thread."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    def is_set(self) -> bool:
        return self._event.is_set()

    def set(self, signal_name: str = "manual") -> None:
        self.signal_name = signal_name
        self._event.set()

    def restore(self) -> None:
        """Put back the handlers that were installed before."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()


def install_sigterm_handler(signals: tuple[int, ...] = (signal.SIGTERM,)) -> PreemptionFlag:
    """Install the handler (main thread only) and return the flag it sets."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("install_sigterm_handler must be called from the main thread (Python delivers "
                           "signals there only)")
    flag = PreemptionFlag()

    def handler(signum: int, frame: Any) -> None:
        if flag.is_set():  # second signal: the user means it
            flag.restore()
            os.kill(os.getpid(), signum)
            return
        flag.set(signal.Signals(signum).name)

    for signum in signals:
        flag._previous[signum] = signal.signal(signum, handler)
    return flag
