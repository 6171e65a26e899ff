"""A worker for tests/faults/test_stores.py: joins the process group as meshrun's trainer does, writes
``ready`` in the folder given as argv[1], and stays in the group until ``stop`` appears there (at most 60 s)."""

import sys
import time
from pathlib import Path

from meshrun.config import DistConfig
from meshrun.comm.process_group import init_distributed, shutdown
from meshrun.env import ProcessPlacement

folder = Path(sys.argv[1])
env = ProcessPlacement.detect()
init_distributed(env, DistConfig(device="cpu", init_timeout_s=30))
(folder / f"ready_{env.rank}").write_text("")
deadline = time.monotonic() + 60
while not (folder / "stop").exists() and time.monotonic() < deadline:
    time.sleep(0.1)
shutdown()
