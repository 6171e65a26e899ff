"""The one object that holds where this process sits (its placement): ranks, nodes and the master address.

Every other module asks a :class:`ClusterEnv` for ranks, nodes and the master address; none of them reads
``RANK``/``LOCAL_RANK``/``SLURM_*`` itself. Where the values come from is the business of the cluster environments
in :mod:`meshrun.placement` (torchrun / ``meshrun launch``, SLURM, Open MPI, a single process, and any registered
with ``register_environment``), tried in order by :meth:`ClusterEnv.detect`.

The record is defined in :mod:`meshrun.placement.cluster_env`, beside the environments that fill it; this module is
the name to import it by. It imports :mod:`meshrun.placement` and nothing there imports it: the dependency runs one
way.
"""

from meshrun.placement.cluster_env import DEFAULT_MASTER_PORT, ClusterEnv, resolve_ipv4_first

__all__ = ["DEFAULT_MASTER_PORT", "ClusterEnv", "resolve_ipv4_first"]
