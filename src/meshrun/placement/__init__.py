"""Where this process sits: an ordered list of cluster environments, the first that detects wins.

``registry.ENVIRONMENTS`` holds torchrun / ``meshrun launch`` (first: ``srun torchrun`` sets SLURM's variables too), SLURM,
Open MPI, and the single-process fallback (last; it always detects). :meth:`meshrun.env.ProcessPlacement.detect` walks it
for the workers' placement; ``meshrun launch`` asks it for the nodes before the workers start
(:func:`detect_node_placement`). Add your own (Kubernetes, LSF, ...) with :func:`register_environment`, or name it
as ``module:Class`` in ``$MESHRUN_ENVIRONMENT`` / ``meshrun launch --environment`` (:func:`load_environment`).
"""

from __future__ import annotations

from meshrun.placement import registry
from meshrun.placement.base import ClusterEnvironment, NodePlacement, PlacementError, env_int
from meshrun.placement.process import DEFAULT_MASTER_PORT, ProcessPlacement
from meshrun.placement.mpi import OpenMPIEnvironment
from meshrun.placement.registry import (ENV_VAR, detect_environment, detect_node_placement, environment_named,
                                       load_environment, register_environment)
from meshrun.placement.single import SingleProcessEnvironment
from meshrun.placement.slurm import SlurmEnvironment, SlurmLayoutError
from meshrun.placement.torchrun import TorchrunEnvironment

# the modules of this package build on one another (interface -> registry -> record -> environments), never in a
# circle; the built-in environments are registered once they exist:
registry.ENVIRONMENTS = (TorchrunEnvironment(), SlurmEnvironment(), OpenMPIEnvironment(), SingleProcessEnvironment())

__all__ = ["DEFAULT_MASTER_PORT", "ENV_VAR", "ProcessPlacement", "ClusterEnvironment", "NodePlacement",
           "OpenMPIEnvironment",
           "PlacementError", "SingleProcessEnvironment", "SlurmEnvironment", "SlurmLayoutError", "TorchrunEnvironment",
           "detect_environment", "detect_node_placement", "env_int", "environment_named", "load_environment",
           "register_environment"]
