"""A plain single process: the fallback, last in the list, which always detects."""

from __future__ import annotations

from typing import Mapping

from meshrun.placement.process import DEFAULT_MASTER_PORT, ProcessPlacement
from meshrun.placement.base import ClusterEnvironment, env_int


class SingleProcessEnvironment(ClusterEnvironment):
    """Rank 0 of a world of 1; MASTER_ADDR/MASTER_PORT are honoured for a process group of one."""

    name = "single"
    title = "single process"

    def detect(self, environ: Mapping[str, str]) -> bool:
        return True

    def placement(self, environ: Mapping[str, str]) -> ProcessPlacement:
        return ProcessPlacement(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, num_nodes=1,
                          master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
                          master_port=env_int(environ, "MASTER_PORT", DEFAULT_MASTER_PORT), source=self.name)
