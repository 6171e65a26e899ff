"""Where this process sits: an ordered list of cluster environments, the first that detects wins.

``ENVIRONMENTS`` holds torchrun / ``meshrun launch`` (first: ``srun torchrun`` sets SLURM's variables too), SLURM,
Open MPI, and the single-process fallback (last; it always detects). :meth:`meshrun.env.ClusterEnv.detect` walks it
for the workers' layout; ``meshrun launch`` asks it for the nodes before the workers start
(:func:`detect_node_placement`). Add your own (Kubernetes, LSF, ...) with :func:`register_environment`.
"""

from __future__ import annotations

from typing import Mapping

from meshrun.placement.base import ClusterEnvironment, NodePlacement, PlacementError, env_int
from meshrun.placement.mpi import OpenMPIEnvironment
from meshrun.placement.single import SingleProcessEnvironment
from meshrun.placement.slurm import SlurmEnvironment, SlurmLayoutError
from meshrun.placement.torchrun import TorchrunEnvironment

ENVIRONMENTS: tuple[ClusterEnvironment, ...] = (TorchrunEnvironment(), SlurmEnvironment(), OpenMPIEnvironment(),
                                                SingleProcessEnvironment())
"""Tried in this order; replaced (never mutated) by :func:`register_environment`."""


def register_environment(environment: ClusterEnvironment, *, before: str = "single") -> None:
    """Insert ``environment`` ahead of the one named ``before`` (default: ahead of the single-process fallback,
    after the built-in ones). Raises ValueError for a duplicate name or an unknown ``before``."""
    global ENVIRONMENTS
    names = [env.name for env in ENVIRONMENTS]
    if not isinstance(environment, ClusterEnvironment) or not environment.name:
        raise ValueError(f"register_environment: {environment!r} is not a ClusterEnvironment with a name; "
                         "subclass meshrun.placement.ClusterEnvironment and set its `name`.")
    if environment.name in names:
        raise ValueError(f"register_environment: an environment named {environment.name!r} is already registered "
                         f"({', '.join(names)}); give yours another name.")
    if before not in names:
        raise ValueError(f"register_environment: before={before!r} names no registered environment; "
                         f"choose one of {', '.join(names)}.")
    index = names.index(before)
    ENVIRONMENTS = (*ENVIRONMENTS[:index], environment, *ENVIRONMENTS[index:])


def detect_environment(environ: Mapping[str, str]) -> ClusterEnvironment:
    """The first environment in :data:`ENVIRONMENTS` that detects this process."""
    for environment in ENVIRONMENTS:
        if environment.detect(environ):
            return environment
    return SingleProcessEnvironment()  # the fallback was unregistered by hand; it is still the right answer


def environment_named(name: str) -> ClusterEnvironment | None:
    """The registered environment whose name is ``name`` (a ``ClusterEnv.source``), else None."""
    return next((env for env in ENVIRONMENTS if env.name == name), None)


def detect_node_placement(environ: Mapping[str, str], *, command: str = "") -> NodePlacement | None:
    """Where this node's ``meshrun launch`` sits, from the first environment that places launchers; None when none
    does (flags or a standalone store decide). Raises :class:`PlacementError` with the command line to run."""
    for environment in ENVIRONMENTS:
        placement = environment.node_placement(environ, command=command)
        if placement is not None:
            return placement
    return None


__all__ = ["ENVIRONMENTS", "ClusterEnvironment", "NodePlacement", "OpenMPIEnvironment", "PlacementError",
           "SingleProcessEnvironment", "SlurmEnvironment", "SlurmLayoutError", "TorchrunEnvironment",
           "detect_environment", "detect_node_placement", "env_int", "environment_named", "register_environment"]
