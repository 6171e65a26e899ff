"""Verdicts on the nodes' system records: a GPU that stays under-used, a network link that stays saturated.

One slow interval is noise (a checkpoint, an evaluation); a condition that holds for ``persist_s`` seconds of
consecutive log intervals is reported once, naming the node, its host and the device or interface, and reported again
only after it has cleared.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

LOW_GPU_UTIL_PCT = 70.0
"""A GPU busier than this is fed well enough; the guides this project follows ask for above 90% in steady state."""
SATURATED_LINK = 0.9
"""A link carrying this fraction of its speed (sent or received) is saturated."""
PERSIST_S = 60.0
"""How long a condition must hold before it is reported."""


@dataclass
class _Episode:
    seconds: float = 0.0
    values: list[float] = field(default_factory=list)
    reported: bool = False


class SystemVerdicts:
    """Fed every node's ``system`` record at each log interval (rank 0); returns the verdicts that became due."""

    def __init__(self, *, low_util_pct: float = LOW_GPU_UTIL_PCT, saturated: float = SATURATED_LINK,
                 persist_s: float = PERSIST_S):
        self.low_util_pct, self.saturated, self.persist_s = low_util_pct, saturated, persist_s
        self.episodes: dict[tuple[Any, ...], _Episode] = {}

    def observe(self, record: dict[str, Any]) -> list[str]:
        """Verdicts (one line each) that this record makes due; [] for most records."""
        node, seconds = record.get("node"), float(record.get("interval_s", 0.0))
        where = f"node {node} (host {record.get('host', '?')})"
        found = []
        for gpu in record.get("gpus", []):
            util = gpu.get("util_pct")
            if util is None:
                continue
            key = (node, "gpu", gpu["index"])
            if self._holds(key, util < self.low_util_pct, util, seconds):
                found.append(f"{where}: GPU {gpu['index']} below {self.low_util_pct:.0f}% busy for "
                             f"{self._seconds(key):.0f} s (mean {self._mean(key):.0f}%): "
                             "it waits on data, the host or the network; compare the nodes' system plots in "
                             "`meshrun report`")
        for name, row in record.get("net", {}).items():
            speed = row.get("speed_mb_s")
            if not speed:
                continue
            share = max(row.get("sent_mb_s", 0.0), row.get("recv_mb_s", 0.0)) / speed
            key = (node, "net", name)
            if self._holds(key, share >= self.saturated, 100 * share, seconds):
                what = f"{name} (the NCCL/gloo interface)" if row.get("comm") else name
                found.append(f"{where}: {what} at {self._mean(key):.0f}% of its {speed * 8 / 1000:.0f} Gb/s for "
                             f"{self._seconds(key):.0f} s: the link is saturated; the job waits on the network "
                             "(fewer bytes per step: larger grad accumulation, FSDP within a node, or a faster NIC)")
        return found

    def _holds(self, key: tuple[Any, ...], condition: bool, value: float, seconds: float) -> bool:
        """Track ``key``'s episode; True exactly once per episode, when it has lasted ``persist_s``."""
        if not condition:
            self.episodes.pop(key, None)
            return False
        episode = self.episodes.setdefault(key, _Episode())
        episode.seconds += seconds
        episode.values.append(value)
        if episode.reported or episode.seconds < self.persist_s:
            return False
        episode.reported = True
        return True

    def _seconds(self, key: tuple[Any, ...]) -> float:
        return self.episodes[key].seconds

    def _mean(self, key: tuple[Any, ...]) -> float:
        values = self.episodes[key].values
        return sum(values) / len(values)
