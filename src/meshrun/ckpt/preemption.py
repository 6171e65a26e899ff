"""SIGTERM (or SIGUSR1) as a request to save and stop, rather than an immediate death.

Schedulers and torchrun's agent send SIGTERM before they kill (torchrun forwards it to every worker and waits
30 s by default; SLURM sends it KillWait seconds ahead at the time limit, or ``--signal=[B:]SIG@N`` seconds ahead).
Lightning users bring ``--signal=USR1@N``, so SIGUSR1 means the same. The handler only sets a flag; the trainer
polls it through ``Checkpointer.should_save``, which all-reduces it so that every rank stops at the same step
even when the signal reached only some of them, saves a final checkpoint and exits with :data:`EXIT_PREEMPTED`.

Repeated signals: slurmstepd sends SIGTERM, SIGCONT, SIGTERM about 9 ms apart to every task, and a launcher may
forward its own copies, so one preemption arrives as a burst. Signals within ``grace_s`` (default
:data:`DEFAULT_GRACE_S`) of the first are ignored: they must not abort the save. The hard stop is the scheduler's
SIGKILL (after KillWait) or torch's agent's (30 s after it forwarded the signal). A signal *later* than the
window runs the previous handler (by default: terminate now), so a user who sends SIGTERM twice, well apart,
still gets an immediate stop.

Ctrl-C (SIGINT, with ``interrupt=True``) means the same as SIGTERM the first time: save at the next log step, then
stop (exit code 130). The handler then gives SIGINT back to the system, so a second Ctrl-C ends the process at once
and without a traceback, even inside a blocking call.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, Callable

DEFAULT_GRACE_S = 30.0
"""Repeated signals this soon after the first are part of the same preemption, not a demand to die now."""

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""What the trainer treats as 'save a checkpoint and stop'."""

EXIT_PREEMPTED = 128 + signal.SIGTERM
"""Exit code of a run stopped early by one of PREEMPTION_SIGNALS (after its final checkpoint): 143, the shell's
code for SIGTERM, whichever of the signals arrived. Never 0: the run did not reach train.steps."""


EXIT_INTERRUPTED = 128 + signal.SIGINT
"""Exit code of a run stopped by Ctrl-C after its final checkpoint: 130, the shell's code for SIGINT."""


def exit_code(signal_name: str | None) -> int:
    """The exit code of a run stopped early by ``signal_name``: 130 after Ctrl-C, else :data:`EXIT_PREEMPTED`."""
    return EXIT_INTERRUPTED if signal_name == "SIGINT" else EXIT_PREEMPTED


def signal_label(name: str | None) -> str:
    """How a message names the signal that stopped a run: 'Ctrl-C (SIGINT)', 'SIGTERM', ..."""
    return "Ctrl-C (SIGINT)" if name == "SIGINT" else name or "a stop signal"


def announce(line: str) -> None:
    """From a signal handler: one line on stderr, in one write (not through sys.stderr, which may be mid-write)."""
    os.write(2, f"meshrun train: {line}\n".encode())


class PreemptionFlag:
    """Set by the signal handler; read by the training loop. Safe to read from any thread."""

    def __init__(self, grace_s: float = DEFAULT_GRACE_S) -> None:
        self._event = threading.Event()
        self.signal_name: str | None = None
        self.grace_s = grace_s
        self.first_at: float | None = None
        """time.monotonic() of the first signal; None before."""
        self.ignored = 0
        """Repeated signals ignored inside the grace window."""
        self._previous: dict[int, Any] = {}

    def is_set(self) -> bool:
        return self._event.is_set()

    def set(self, signal_name: str = "manual") -> None:
        self.signal_name = signal_name
        self.first_at = time.monotonic()
        self._event.set()

    def in_grace(self) -> bool:
        """True while a repeated signal still belongs to the first one's burst."""
        return self.first_at is not None and time.monotonic() - self.first_at < self.grace_s

    def install(self, signals: tuple[int, ...], handler: Any) -> None:
        """Install ``handler`` for ``signals`` (main thread only), remembering what ``restore`` puts back."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("signal handlers can be installed from the main thread only (Python delivers "
                               "signals there only)")
        for signum in signals:
            self._previous.setdefault(signum, signal.signal(signum, handler))

    def restore(self) -> None:
        """Put back the handlers that were installed before."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()


def install_sigterm_handler(signals: tuple[int, ...] = PREEMPTION_SIGNALS, *, grace_s: float = DEFAULT_GRACE_S,
                            interrupt: bool = False, announce: Callable[[str], None] | None = None) -> PreemptionFlag:
    """Install the handler for ``signals`` (and SIGINT with ``interrupt``; main thread only); return the flag it sets.

    The first signal sets the flag; repeats within ``grace_s`` are counted and ignored; a repeat after that
    restores the previous handlers and re-raises the signal (by default: terminate now). The first SIGINT sets the
    flag too, calls ``announce`` with one line, and leaves SIGINT to the system: the next one ends the process.
    """
    flag = PreemptionFlag(grace_s=grace_s)

    def handler(signum: int, frame: Any) -> None:
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C: the system ends the process at once
            if flag.is_set():  # Ctrl-C after a SIGTERM: the user wants it to end now
                os.kill(os.getpid(), signal.SIGINT)
                return
            if announce is not None:
                announce("Ctrl-C: saving a checkpoint at the next log step, then stopping (exit code 130); press "
                         "Ctrl-C again to stop at once without it")
        if not flag.is_set():
            flag.set(signal.Signals(signum).name)
        elif flag.in_grace():  # the same preemption's burst: keep saving
            flag.ignored += 1
        else:  # long after the first: the user means it
            flag.restore()
            os.kill(os.getpid(), signum)

    flag.install((*signals, signal.SIGINT) if interrupt else signals, handler)
    return flag
