"""Clock skew between nodes, for ``meshrun doctor``.

Log timestamps of different nodes are compared by people chasing a failure, and time-based checkpoint intervals and
heartbeat ages read wall clocks; a node whose clock is off by seconds makes both misleading. All ranks leave a
barrier together, read their wall clock, and gather the readings; each rank's offset from rank 0 is the median
over a few rounds. The barrier's own spread (a network round trip, well under a millisecond on a LAN) bounds the
resolution, far below any threshold worth warning about.

``MESHRUN_FAKE_CLOCK_OFFSET_S`` adds that many seconds to this process's readings: a hook for tests and for
rehearsing the report, since setting a real clock needs root on the host.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from meshrun.diag.rows import PASS, WARN, CheckRow, node_label
from meshrun.env import ProcessPlacement

FAKE_OFFSET_VAR = "MESHRUN_FAKE_CLOCK_OFFSET_S"


def wall_time() -> float:
    """Seconds since the epoch, plus the test hook's offset when set."""
    return time.time() + float(os.environ.get(FAKE_OFFSET_VAR) or 0.0)


def measure_offsets(env: ProcessPlacement, *, rounds: int = 5) -> list[float]:
    """Every rank's clock minus rank 0's, in seconds (the same list on every rank). Collectives every rank must
    reach, on the default group (CPU tensors: doctor's group is gloo)."""
    readings = []
    for _ in range(rounds):
        dist.barrier()  # note: collective; everyone reads the clock right after leaving it
        mine = torch.tensor([wall_time()], dtype=torch.float64)
        parts = [torch.empty_like(mine) for _ in range(env.world_size)]
        dist.all_gather(parts, mine)  # note: collective
        readings.append([float(p.item()) for p in parts])
    return [statistics.median(r[rank] - r[0] for r in readings) for rank in range(env.world_size)]


def judge_clock(offsets: dict[tuple[int, str], float], *, max_skew_s: float) -> CheckRow:
    """``offsets``: {(node, host): seconds relative to node 0}. Warn naming the nodes beyond ``max_skew_s``."""
    skewed = {key: off for key, off in offsets.items() if abs(off) > max_skew_s}
    spread = max(offsets.values()) - min(offsets.values()) if offsets else 0.0
    if not skewed:
        return CheckRow("clock skew", PASS, f"clocks agree within {spread * 1e3:.1f} ms (threshold "
                                            f"{max_skew_s:g} s)")
    named = "; ".join(f"{node_label(node, host)} is {off:+.2f} s from node 0" for (node, host), off in skewed.items())
    return CheckRow("clock skew", WARN, f"{named} (threshold {max_skew_s:g} s): log timestamps across nodes and "
                                        "time-based intervals will not line up",
                    fix="run NTP/chrony on every node", next_command="chronyc tracking (or timedatectl) on "
                    + ", ".join(sorted({host for _, host in skewed})), hosts=tuple(host for _, host in skewed))
