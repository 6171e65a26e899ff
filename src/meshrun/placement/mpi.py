"""Open MPI's ``mpirun``: one process per worker, ranks from ``OMPI_COMM_WORLD_*``.

``mpirun -np 16 --npernode 8 -x MASTER_ADDR=node01 -x MASTER_PORT=29500 meshrun train ...`` starts the workers;
torch.distributed then meets at MASTER_ADDR (mpirun names no rendezvous host, so it must be given). It is also the
worked example of a placement plug-in (docs/architecture.md, "A placement"): one class, two methods.
"""

from __future__ import annotations

from typing import Mapping

from meshrun.placement.process import DEFAULT_MASTER_PORT, ProcessPlacement
from meshrun.placement.base import ClusterEnvironment, env_int


class OpenMPIEnvironment(ClusterEnvironment):
    """Open MPI sets the world and local rank and size; the node rank is derived as rank // local size, which
    holds when every node runs the same number of processes and ranks fill nodes in order (mpirun's default
    ``--map-by slot``/``core``), and is refused otherwise rather than guessed."""

    name = "openmpi"
    title = "Open MPI"
    rank_vars = "OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE"
    local_vars = "OMPI_COMM_WORLD_LOCAL_RANK/OMPI_COMM_WORLD_LOCAL_SIZE"
    node_vars = "OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_LOCAL_SIZE"

    def detect(self, environ: Mapping[str, str]) -> bool:
        # a single process (mpirun -np 1) needs no rendezvous: leave it to the single-process fallback
        return "OMPI_COMM_WORLD_RANK" in environ and environ.get("OMPI_COMM_WORLD_SIZE", "1") != "1"

    def placement(self, environ: Mapping[str, str]) -> ProcessPlacement:
        rank, world_size = env_int(environ, "OMPI_COMM_WORLD_RANK"), env_int(environ, "OMPI_COMM_WORLD_SIZE")
        local_rank = env_int(environ, "OMPI_COMM_WORLD_LOCAL_RANK")
        local_size = env_int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE")
        if local_size < 1 or world_size % local_size:
            raise ValueError(
                f"Open MPI: OMPI_COMM_WORLD_SIZE={world_size} is not a multiple of OMPI_COMM_WORLD_LOCAL_SIZE="
                f"{local_size}, so the nodes run different numbers of processes and the node rank cannot be derived "
                "from the rank; run the same number on every node (mpirun --npernode N), or start the workers with "
                "meshrun launch / torchrun, which number nodes themselves.")
        if rank % local_size != local_rank:
            raise ValueError(
                f"Open MPI: rank {rank} has local rank {local_rank}, but ranks that fill nodes in order would give "
                f"{rank % local_size} (of {local_size} per node): the processes are mapped round-robin, so the node "
                "rank cannot be derived from the rank; run mpirun with --map-by slot (or core), not --map-by node.")
        master = environ.get("MASTER_ADDR")
        if not master:
            raise ValueError(
                "Open MPI: MASTER_ADDR is not set, and mpirun names no rendezvous host; pass the address of the "
                "node that runs rank 0 to every process: mpirun -x MASTER_ADDR=<host> -x MASTER_PORT=<port> ...")
        return ProcessPlacement(rank=rank, local_rank=local_rank, world_size=world_size, local_world_size=local_size,
                          node_rank=rank // local_size, num_nodes=world_size // local_size, master_addr=master,
                          master_port=env_int(environ, "MASTER_PORT", DEFAULT_MASTER_PORT), source=self.name)
