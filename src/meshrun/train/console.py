"""The one format of meshrun's own lines on the console: ``warning: ...``, as the trainer prints its warnings.

Rank 0's log records at WARNING and above reach the console with this format; every rank's log file keeps a
timestamp and the rank in each line (train/trainer.py sets both up). torch's own lines (``W1126 ...``) keep
torch's format: they come from its C++ logger and its launcher, not from meshrun.
"""

from __future__ import annotations

import logging


class ConsoleFormatter(logging.Formatter):
    """'warning: <message>' (the level in lower case, no timestamp or rank: rank 0 alone writes to the console)."""

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return f"{record.levelname.lower()}: {text}"
