"""ParallelDims: the parallel degrees of a job, their validation, and the one DeviceMesh built from them.

The axes are listed once, in :data:`meshrun.comm.axes.AXES`, outermost first (torchtitan's order)::

    ("pp", "dp_replicate", "dp_shard", "cp", "tp")

and everything else -- the mesh, :class:`RankCoords`, :meth:`ParallelDims.coords` / :meth:`~ParallelDims.rank_of`,
the groups, the planner and the layout a checkpoint records -- is derived from that list. A global rank is the
row-major index of its coordinates, ``(((pp * dp_replicate + r) * dp_shard + s) * cp + c) * tp + t``. TP is
innermost: with ``tp`` dividing the GPUs of a node, every TP group lies inside one node (NVLink); CP next, so a
ring of cp x tp ranks stays inside a node when it fits. PP is outermost: its groups cross nodes, where point-to-point
traffic is cheapest. The coordinates and group arithmetic always use every axis, so they read the same for every
layout. The DeviceMesh, though, has only the dimensions of degree > 1 (:meth:`ParallelDims.mesh_dim_names`), as
torchtitan's: a dimension of degree 1 would cost one process group per rank for nothing. Flattened dimensions
(:data:`FLAT_DIMS`) join several: "dp" (dp_replicate x dp_shard: the data shards) and "dp_shard_cp" (dp_shard x cp:
what FSDP shards parameters over, since the cp ranks of a replica hold the same parameters). A flattened dimension
with one enabled member is that member's mesh. :meth:`ParallelDims.get_optional_mesh` returns None for a degree of 1.

Adding an axis: one :class:`Axis` entry in comm/axes.py (and a ``parallel.<name>`` degree in config.py), then its
apply step in parallel/apply.py; docs/architecture.md lists the files.

Everything except :meth:`ParallelDims.build_mesh` (and :func:`node_mesh`, the 2-D node x local mesh that
``meshrun bench`` measures links with) is pure arithmetic (no process group), so the planner uses the
same coordinates and groups as the real job.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from meshrun.comm.axes import AXES, FLAT_DIMS, MESH_DIMS, Axis, RankCoords, resolve_degrees
from meshrun.config import (MULTI_STAGE_SCHEDULES, MULTIPLE_OF_PP_SCHEDULES, PIPELINE_SCHEDULES, ConfigError,
                            ParallelConfig)
from meshrun.comm.dp_choice import FSDP_AUTO_PARAMS, choose_data_parallel  # noqa: F401 - re-exported
from meshrun.parallel.stage_cut import default_microbatches, describe_cut, resolve_cut

__all__ = ["AXES", "FLAT_DIMS", "MESH_DIMS", "Axis", "ParallelDims", "RankCoords", "choose_data_parallel",
           "node_mesh", "resolve_degrees"]

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from meshrun.models.shape import ModelShape
    from meshrun.models.spec import ModelSpec



@dataclass(eq=False)
class ParallelDims:
    """Degrees of each parallel dimension (all resolved: no -1) and the pipeline settings that go with them.

    Build it with :meth:`from_config`, which infers -1 and validates; the constructor only checks the product.
    """

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world_size: int
    cp: int = 1
    """Context parallelism: ranks that split each sequence (ring attention)."""
    pp_schedule: str = "1f1b"
    pp_microbatches: int = 1
    """Pipeline micro-batches per optimizer step (resolved; 1 without PP)."""
    pp_virtual_stages: int = 1
    """Stages per pipeline rank (>1 only with the MULTI_STAGE_SCHEDULES)."""
    pp_balance: str = "cost"
    """How the blocks are cut into stages: by estimated cost or by count (parallel.pp_balance)."""
    pp_layers: tuple[int, ...] = ()
    """Blocks per pipeline stage, resolved by validate_model (empty: not resolved, an even cut)."""
    pp_shares: tuple[float, ...] = ()
    """Each stage's estimated share of the work, beside pp_layers."""
    gpus_per_node: int = 0
    """GPUs (processes) per node; 0 when unknown (then TP-across-nodes is not checked)."""
    allow_tp_across_nodes: bool = False
    _meshes: dict[str | tuple[str, ...], Any] = field(default_factory=dict, repr=False)
    _mesh_built: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        product = math.prod(self.shape)
        if product != self.world_size:
            names = " x ".join(name for name in MESH_DIMS)
            values = " x ".join(str(value) for value in self.shape)
            raise ConfigError(
                f"parallel.{names} = {values} = {product} does not equal the world size {self.world_size}; change a "
                "degree or set one of them to -1 to infer it")

    # ---- construction from the job config ---------------------------------------------------------------------

    @classmethod
    def from_config(cls, parallel: ParallelConfig, *, world_size: int, gpus_per_node: int = 0,
                    model: ModelShape | None = None, spec: ModelSpec | None = None) -> ParallelDims:
        """Resolve -1 degrees against ``world_size`` and validate everything that can be checked without a model
        (and, when ``model`` is given, against the model's shapes). Raises ConfigError naming the option."""
        degrees = resolve_degrees({name: getattr(parallel, name) for name in MESH_DIMS}, world_size=world_size)
        if parallel.pp_schedule not in PIPELINE_SCHEDULES:
            raise ConfigError(f"parallel.pp_schedule={parallel.pp_schedule!r} is not one of "
                              f"{', '.join(PIPELINE_SCHEDULES)}")
        if parallel.pp_schedule == "auto":  # unresolved (a plan resolves it: meshrun.comm.schedule_choice): 1F1B
            parallel = dataclasses.replace(parallel, pp_schedule="1f1b")
        interleaved = parallel.pp_schedule in MULTI_STAGE_SCHEDULES
        virtual = parallel.pp_virtual_stages if interleaved and degrees["pp"] > 1 else 1
        if virtual < 1:
            raise ConfigError(f"parallel.pp_virtual_stages must be >= 1, got {parallel.pp_virtual_stages}")
        # with PP, 0 = chosen from the batch by resolve_pipeline_batch
        microbatches = parallel.pp_microbatches if degrees["pp"] > 1 else 1
        dims = cls(**degrees, world_size=world_size, pp_schedule=parallel.pp_schedule,
                   pp_microbatches=microbatches, pp_virtual_stages=virtual, pp_balance=parallel.pp_balance,
                   gpus_per_node=gpus_per_node, allow_tp_across_nodes=parallel.allow_tp_across_nodes)
        dims.validate()
        if model is not None:
            if spec is None:
                raise ValueError("ParallelDims.from_config: model= needs spec= (the model's ModelSpec)")
            dims.validate_model(model, spec)
        return dims

    def validate(self) -> None:
        """Checks of the degrees against each other and the node size."""
        if self.cp > 1:
            self._validate_cp()
        if self.pp > 1 and self.pp_microbatches:
            self._validate_schedule()
        if self.gpus_per_node and self.tp > 1 and not self.allow_tp_across_nodes:
            if self.tp > self.gpus_per_node:
                raise ConfigError(
                    f"parallel.tp={self.tp} is larger than the {self.gpus_per_node} GPUs of one node, so tensor-"
                    "parallel all-reduces (several per layer) would cross the network; lower parallel.tp (use "
                    "parallel.pp or dp across nodes) or set --parallel.allow_tp_across_nodes=true")
            if self.gpus_per_node % self.tp and self.world_size > self.gpus_per_node:  # one node: nothing straddles
                raise ConfigError(
                    f"parallel.tp={self.tp} does not divide the {self.gpus_per_node} GPUs per node, so some tensor-"
                    "parallel groups would straddle two nodes; choose a tp that divides it or set "
                    "--parallel.allow_tp_across_nodes=true")

    def _validate_cp(self) -> None:
        if self.pp > 1:
            raise ConfigError(f"parallel.cp={self.cp} with parallel.pp={self.pp}: context parallelism does not run "
                              "inside pipeline stages yet; use cp with dp_shard/dp_replicate and tp, or set "
                              "--parallel.cp=1")
        if self.gpus_per_node and self.cp * self.tp > self.gpus_per_node:
            import logging

            logging.getLogger("meshrun").warning(
                "parallel.cp=%d x tp=%d = %d ranks is more than the %d GPUs of one node: the ring attention's K/V "
                "exchange (every layer, forward and backward) crosses the network", self.cp, self.tp,
                self.cp * self.tp, self.gpus_per_node)

    def _validate_schedule(self) -> None:
        m, p = self.pp_microbatches, self.pp
        if m < p:
            raise ConfigError(
                f"parallel.pp_microbatches={m} is fewer than the {p} pipeline stages (parallel.pp={p}); the "
                f"{self.pp_schedule} schedule never fills the pipeline. Use --parallel.pp_microbatches={2 * p} or more")
        if self.pp_schedule in MULTIPLE_OF_PP_SCHEDULES and m % p:
            raise ConfigError(
                f"parallel.pp_microbatches={m} must be a multiple of parallel.pp={p} for {self.pp_schedule}; "
                f"use {p * math.ceil(m / p)}")

    def validate_model(self, model: ModelShape, spec: ModelSpec) -> None:
        """Through the model's contract: TP needs the spec's plan and must divide the sizes its ``tp_checks`` names
        (heads, widths, vocabulary); PP needs at least one block per stage and no auxiliary loss term; then the
        spec's own ``validate``."""
        if self.tp > 1 and spec.tp_plan is None:
            raise ConfigError(f"parallel.tp={self.tp}: model.arch={spec.arch!r} has no tensor-parallel plan "
                              "(ModelSpec.tp_plan); use --parallel.tp=1")
        if self.pp > 1 and spec.aux_loss is not None:
            raise ConfigError(f"parallel.pp={self.pp}: model.arch={spec.arch!r} has an auxiliary loss term "
                              "(ModelSpec.aux_loss), which pipeline stages do not add to the loss; use --parallel.pp=1 "
                              "(FSDP, TP and CP add it)")
        for option, value in spec.tp_checks(model) if self.tp > 1 else ():
            if value % self.tp:
                raise ConfigError(
                    f"parallel.tp={self.tp} does not divide {option}={value}; each tensor-parallel rank must hold "
                    f"a whole share. Choose a tp that divides {value}")
        if self.cp > 1 and model.seq_len % (2 * self.cp):
            raise ConfigError(
                f"parallel.cp={self.cp} needs model.seq_len={model.seq_len} divisible by 2 x cp = {2 * self.cp}: each "
                "rank takes one chunk from the head and one from the tail of every sequence (causal load balance); "
                f"choose a seq_len that is a multiple of {2 * self.cp}")
        if self.cp > 1 and model.dropout:
            raise ConfigError(f"parallel.cp={self.cp} with model.dropout={model.dropout}: ring attention runs without "
                              "attention dropout; set --model.dropout=0 or --parallel.cp=1")
        stages = self.pp * self.pp_virtual_stages
        if stages > model.n_layers:
            what = f"parallel.pp={self.pp}" + (f" x parallel.pp_virtual_stages={self.pp_virtual_stages}"
                                               if self.pp_virtual_stages > 1 else "")
            raise ConfigError(f"{what} = {stages} pipeline stages but the model has only model.n_layers="
                              f"{model.n_layers}; every stage needs at least one layer. Lower parallel.pp"
                              + (" or parallel.pp_virtual_stages" if self.pp_virtual_stages > 1 else "")
                              + f", or set --model.n_layers={stages}")
        if spec.validate is not None:
            spec.validate(model, self)
        if self.pp > 1:
            counts, shares = resolve_cut(spec, model, stages, self.pp_balance)
            self.pp_layers, self.pp_shares = tuple(counts), tuple(shares)

    def default_microbatches(self, samples_per_step: int, seq_len: int = 0) -> int:
        """What parallel.pp_microbatches=0 makes of a dp rank's ``samples_per_step`` for this pipeline's stages
        and schedule (:func:`default_microbatches`)."""
        return default_microbatches(samples_per_step, seq_len, pp=self.pp, virtual_stages=self.pp_virtual_stages,
                                    multiple_of_pp=self.pp_schedule in MULTIPLE_OF_PP_SCHEDULES)

    def resolve_pipeline_batch(self, samples_per_step: int, seq_len: int = 0) -> None:
        """With PP, a dp rank's samples per step (micro_batch x grad_accum) must split into the micro-batches.
        parallel.pp_microbatches=0 resolves here to :func:`default_microbatches`: the count whose bubble and
        per-micro-batch cost add up to the shortest step (one per sample without ``seq_len``)."""
        if self.pp > 1 and not self.pp_microbatches:
            self.pp_microbatches = self.default_microbatches(samples_per_step, seq_len)
            try:
                self._validate_schedule()
            except ConfigError as err:
                raise ConfigError(f"{err} (parallel.pp_microbatches=0 chose {self.pp_microbatches} for "
                                  f"{samples_per_step} samples per data-parallel rank per step, train.micro_batch "
                                  "x grad_accum)") from None
        if self.pp > 1 and samples_per_step % self.pp_microbatches:
            raise ConfigError(
                f"parallel.pp_microbatches={self.pp_microbatches} does not divide the {samples_per_step} samples each "
                "data-parallel rank processes per step (train.micro_batch x grad_accum); change "
                "parallel.pp_microbatches or train.micro_batch")

    # ---- pure arithmetic: sizes, coordinates, groups ------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, ...]:
        """The degrees in mesh order (:data:`MESH_DIMS`)."""
        return tuple(getattr(self, name) for name in MESH_DIMS)

    def degrees(self) -> dict[str, int]:
        """``{axis: degree}`` in mesh order: what the planner prints and a checkpoint's layout records."""
        return dict(zip(MESH_DIMS, self.shape))

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: model replicas that see different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def stages(self) -> int:
        """Pipeline stages in total (pp x virtual stages per rank)."""
        return self.pp * self.pp_virtual_stages

    def degree(self, name: str) -> int:
        if name in FLAT_DIMS:
            return math.prod(self.degree(d) for d in FLAT_DIMS[name])
        if name not in MESH_DIMS:
            raise ValueError(f"unknown mesh dimension {name!r}; known: {', '.join(MESH_DIMS + tuple(FLAT_DIMS))}")
        return getattr(self, name)

    def enabled(self, name: str) -> bool:
        return self.degree(name) > 1

    def coords(self, rank: int) -> RankCoords:
        """Mesh coordinates of a global rank (row-major over MESH_DIMS: the last axis varies fastest)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        values = []
        for size in reversed(self.shape):
            rank, index = divmod(rank, size)
            values.append(index)
        return RankCoords(*reversed(values))

    def rank_of(self, coords: RankCoords) -> int:
        """The global rank at ``coords`` (the inverse of :meth:`coords`)."""
        rank = 0
        for index, size in zip(coords, self.shape):
            rank = rank * size + index
        return rank

    def dp_rank(self, rank: int) -> int:
        """Index of the data shard a global rank reads (tp, cp and pp peers read the same one; cp peers then take
        their parts of each sequence)."""
        c = self.coords(rank)
        return c.dp_replicate * self.dp_shard + c.dp_shard

    def group(self, name: str, rank: int) -> list[int]:
        """Global ranks in ``rank``'s group along ``name`` (a mesh dimension or "dp"), in mesh order."""
        varying = FLAT_DIMS.get(name, (name,))
        self.degree(name)  # validates the name
        base = self.coords(rank)._asdict()
        ranks = []
        for index in range(self.degree(name)):
            coords = dict(base)
            for dim in reversed(varying):  # the last listed dimension varies fastest
                index, coords[dim] = divmod(index, self.degree(dim))
            ranks.append(self.rank_of(RankCoords(**coords)))
        return ranks

    def groups(self, name: str) -> list[list[int]]:
        """All groups along ``name``, each listed once, ordered by their smallest rank."""
        seen: dict[int, list[int]] = {}
        for rank in range(self.world_size):
            members = self.group(name, rank)
            seen.setdefault(members[0], members)
        return [seen[k] for k in sorted(seen)]

    def describe(self) -> str:
        parts = [f"{name} {self.degree(name)}" for name in MESH_DIMS]
        text = " x ".join(parts) + f" = {self.world_size} rank{'' if self.world_size == 1 else 's'}"
        if self.pp > 1:
            text += f"; pipeline {self.pp_schedule}, {self.pp_microbatches} micro-batches"
            if self.pp_virtual_stages > 1:
                text += f", {self.pp_virtual_stages} stages per rank"
            if self.pp_layers:
                text += f", {describe_cut(self.pp_layers, self.pp_shares)}"
        return text

    # ---- the DeviceMesh ---------------------------------------------------------------------------------------

    @property
    def fsdp_replicates(self) -> bool:
        """FSDP2 (not DDP) replicates over dp_replicate without sharding: with TP or PP the parameters are DTensors
        or pipeline stages, which DDP does not take."""
        return self.dp_replicate > 1 and self.dp_shard == 1 and self.cp == 1 and (self.tp > 1 or self.pp > 1)

    def mesh_dim_names(self) -> tuple[str, ...]:
        """The dimensions the DeviceMesh has, outermost first: those of degree > 1, plus ``dp_shard`` of degree 1
        when :attr:`fsdp_replicates` (FSDP2 replicates only through a 2-D (replicate, shard) mesh). Empty for one
        rank."""
        names = [name for name in MESH_DIMS if self.degree(name) > 1]
        if self.fsdp_replicates:
            names.insert(names.index("dp_replicate") + 1, "dp_shard")
        return tuple(names)

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """Create the DeviceMesh of :meth:`mesh_dim_names` and its named sub-meshes; None for one rank.

        Collective: every rank must call this (it creates one process group per mesh dimension, and one per
        flattened dimension with two or more enabled members ("dp", "dp_shard_cp"); a group of every rank is the
        default group, not a new one). This module is the only place in meshrun that creates a DeviceMesh.
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        self._meshes, self._mesh_built = {}, True
        if self.world_size == 1 and not dist.is_initialized():
            return None
        if dist.get_world_size() != self.world_size:
            raise ConfigError(f"the process group has {dist.get_world_size()} ranks but the layout was resolved "
                              f"for world size {self.world_size}")
        names = self.mesh_dim_names()
        if not names:  # one rank: every degree is 1
            return None
        mesh = init_device_mesh(device_type, tuple(self.degree(n) for n in names), mesh_dim_names=names)
        self._meshes["world"] = mesh
        for name in names:
            self._meshes[name] = mesh if len(names) == 1 else mesh[name]
        for flat, joined in FLAT_DIMS.items():
            enabled = tuple(name for name in joined if self.degree(name) > 1)
            if len(enabled) == 1:
                self._meshes[flat] = self._meshes[enabled[0]]
            elif enabled:  # kept here: slicing flat dims from the root is deprecated; private: DeviceMesh has no public
                # flatten (2.8 to 2.13; torchtitan uses the same)
                self._meshes[flat] = self._submesh(enabled)._flatten(flat)
        return mesh

    def all_meshes(self) -> list[DeviceMesh]:
        """The root mesh and every named sub-mesh built so far (empty before :meth:`build_mesh` and for one rank)."""
        return list({id(mesh): mesh for mesh in self._meshes.values()}.values())

    @property
    def mesh(self) -> DeviceMesh:
        """The whole mesh, of the enabled dimensions (after :meth:`build_mesh`)."""
        return self.get_mesh("world")

    def get_mesh(self, name: str | tuple[str, ...]) -> DeviceMesh:
        """The (sub-)mesh called ``name``: a dimension, "dp", "world" or a tuple such as ("dp_replicate", "dp_shard").

        Raises when the mesh is not built, the name is unknown, or the dimension has degree 1 (not enabled).
        """
        mesh = self.get_optional_mesh(name)
        if mesh is None:
            names = name if isinstance(name, tuple) else (name,)
            sizes = ", ".join(f"{n}={self.world_size if n == 'world' else self.degree(n)}" for n in names)
            raise ValueError(f"mesh dimension {name!r} is not enabled ({sizes}); use get_optional_mesh to allow that")
        return mesh

    def get_optional_mesh(self, name: str | tuple[str, ...]) -> DeviceMesh | None:
        """Like :meth:`get_mesh`, but None when the dimension(s) have degree 1 (so the mesh lacks them).

        A tuple leaves out its dimensions of degree 1 that the mesh lacks: ("dp_replicate", "dp_shard") is the 1-D
        dp_shard mesh when dp_replicate is 1, and the 2-D HSDP mesh when :meth:`mesh_dim_names` has both. A tuple
        may name a flattened dimension: ("dp_replicate", "dp_shard_cp") is FSDP's HSDP mesh under context
        parallelism.
        """
        if not self._mesh_built:
            raise RuntimeError("ParallelDims.build_mesh(device_type) must run before the mesh is used")
        key = name[0] if isinstance(name, tuple) and len(name) == 1 else name
        if key == "world":
            return self._meshes.get(key)
        names = key if isinstance(key, tuple) else (key,)
        if not set(names) <= set(MESH_DIMS) | set(FLAT_DIMS):
            raise ValueError(f"unknown mesh {name!r}; known: world, {', '.join(MESH_DIMS + tuple(FLAT_DIMS))} "
                             "or a tuple of mesh dimensions in mesh order")
        if math.prod(self.degree(n) for n in names) == 1:
            return None
        if key not in self._meshes:  # a tuple: slicing reuses the root's groups and creates none
            self._meshes[key] = self._submesh(self._root_names(names))
        return self._meshes[key]

    def _root_names(self, names: tuple[str, ...]) -> tuple[str, ...]:
        """The names to slice the root mesh by: dimensions the mesh has, and each flattened dimension as itself
        (when built from two or more members) or as its one enabled member."""
        out: list[str] = []
        for name in names:
            if name in FLAT_DIMS:
                members = tuple(n for n in FLAT_DIMS[name] if self.degree(n) > 1)
                out += [name] if len(members) > 1 else list(members)
            elif name in self.mesh_dim_names():
                out.append(name)
        return tuple(out)

    def _submesh(self, names: tuple[str, ...]) -> DeviceMesh:
        root = self._meshes["world"]
        if names == tuple(root.mesh_dim_names):
            return root
        if len(names) == 1:
            return self._meshes[names[0]]
        with warnings.catch_warnings():
            # torch 2.13 warns that slicing a flattened dimension from the root will be deprecated; it is the way
            # to get FSDP's 2-D (dp_replicate, dp_shard_cp) mesh without new process groups on torch 2.8 to 2.13
            # (torchtitan does the same)
            warnings.filterwarnings("ignore", message=".*flattened dim from root mesh.*")
            return root[names]


def node_mesh(*, num_nodes: int, local_world_size: int, device_type: str) -> DeviceMesh:
    """A 2-D mesh ("node", "local") of the default group, for measuring links: ``mesh["local"]`` groups the ranks
    of one node (intra-node), ``mesh["node"]`` the ranks of one local index across nodes (inter-node).

    Collective: every rank must call this. Assumes node-major ranks (rank = node * local_world_size + local rank),
    as torchrun and ``meshrun launch`` number them.
    """
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (num_nodes, local_world_size), mesh_dim_names=("node", "local"))
