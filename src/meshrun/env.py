"""The one object that holds where this process sits (its placement): ranks, nodes and the master address.

Every other module asks a :class:`ProcessPlacement` for ranks, nodes and the master address; none of them reads
``RANK``/``LOCAL_RANK``/``SLURM_*`` itself. Where the values come from is the business of the cluster environments
in :mod:`meshrun.placement` (torchrun / ``meshrun launch``, SLURM, Open MPI, a single process, and any registered
with ``register_environment``), tried in order by :meth:`ProcessPlacement.detect`.

The record is defined in :mod:`meshrun.placement.process`, beside the environments that fill it; this module is
the name to import it by. It imports :mod:`meshrun.placement` and nothing there imports it: the dependency runs one
way.
"""

from meshrun.placement.process import DEFAULT_MASTER_PORT, ProcessPlacement, resolve_ipv4_first

ClusterEnv = ProcessPlacement
"""The record's earlier name, kept so that code importing ``meshrun.env.ClusterEnv`` keeps working. It was too close to
:class:`meshrun.ClusterEnvironment` (a scheduler plug-in that *fills* this record): use ``ProcessPlacement``."""

__all__ = ["DEFAULT_MASTER_PORT", "ClusterEnv", "ProcessPlacement", "resolve_ipv4_first"]
