"""torchrun and ``meshrun launch`` workers: the variables torch's elastic agent sets for each worker."""

from __future__ import annotations

from typing import Mapping

from meshrun.placement.process import DEFAULT_MASTER_PORT, ProcessPlacement
from meshrun.placement.base import ClusterEnvironment, env_int


class TorchrunEnvironment(ClusterEnvironment):
    """``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR/PORT``.

    Listed before the schedulers: ``srun torchrun ...`` sets both, and the worker's own variables are torchrun's.
    """

    name = "torchrun"
    title = "torchrun"

    def detect(self, environ: Mapping[str, str]) -> bool:
        return "RANK" in environ and "WORLD_SIZE" in environ

    def placement(self, environ: Mapping[str, str]) -> ProcessPlacement:
        world_size = env_int(environ, "WORLD_SIZE")
        local_world_size = env_int(environ, "LOCAL_WORLD_SIZE", 1)
        # torchrun sets GROUP_RANK to the agent's rank, which is the node rank for one agent per node.
        node_rank = env_int(environ, "GROUP_RANK", env_int(environ, "NODE_RANK", 0))
        num_nodes = env_int(environ, "GROUP_WORLD_SIZE", max(1, world_size // max(1, local_world_size)))
        return ProcessPlacement(rank=env_int(environ, "RANK"), local_rank=env_int(environ, "LOCAL_RANK", 0),
                          world_size=world_size, local_world_size=local_world_size, node_rank=node_rank,
                          num_nodes=num_nodes, master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
                          master_port=env_int(environ, "MASTER_PORT", DEFAULT_MASTER_PORT), source=self.name)
