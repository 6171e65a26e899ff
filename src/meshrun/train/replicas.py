"""Replica groups joined by torchft: several whole jobs of one layout that keep training when one of them is lost.

Each replica group is a normal meshrun job (DDP, FSDP, TP or PP inside it, its own launcher and process group).
torchft's Manager joins the groups: rank r of every group forms one cross-group process group, re-formed at each
quorum, and a torchft lighthouse (``meshrun lighthouse``) decides which groups take part in each step.

One step, in the order the trainer and ``Session`` call it (all collectives here are across groups, rank r with
rank r; the group's own collectives stay in its own process group):

1. ``start_step``: quorum (synchronous: torchft's async quorum crashed in FSDP's backward in 2 of 3 runs); a group
   that is behind (restarted) receives model, optimizer, scheduler, data position and step from a live peer before
   its forward pass, and re-derives its random streams from (seed, its global rank, step).
2. the group's forward and backward: gradients reduced inside the group as the layout does.
3. ``average_gradients``: every local gradient shard all-reduced (average) across the live groups through
   ``manager.allreduce`` -- never torchft's DistributedDataParallel wrapper, whose comm hook fails the survivor
   (``assert fut._fut``) when a peer dies mid all-reduce -- then ``should_commit``, a vote of every group. False
   when any group failed during the step: the gradients are dropped, the data position rewinds, the step runs again.
4. the optimizer steps only on a commit; the step counter is the manager's.

Data: group g of N reads data-parallel shard g*dp + dp_rank of N*dp; the position advances by all N groups' batch
per committed step, so the samples of a group that is absent for a step are skipped, not re-read. Each group's
gradient is the mean over its own batch; averaging over the live groups makes the update the mean over every live
sample, so the learning rate stays and the effective batch is (live groups) x (group batch).
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from meshrun.config import ConfigError, JobConfig, ReplicaConfig
from meshrun.ckpt.state import reseed_rng
from meshrun.comm.store import bound_tcp_store
from meshrun.env import ProcessPlacement
from meshrun.launch.net import EndpointError, Route, is_loopback, probe_tcp, route_to

log = logging.getLogger("meshrun")

BUCKET_BYTES = 64 * 2**20
"""Gradients are all-reduced across groups in flat buckets of about this size (one collective each)."""


def group_run_dir(job: JobConfig) -> Path:
    """<run.dir>/group_<g> for this group's logs and metrics (<run.dir> without replica groups)."""
    root = Path(job.run.dir)
    return root / f"group_{job.replicas.group}" if job.replicas.groups else root


def group_checkpoint_dir(job: JobConfig) -> str:
    """checkpoint.dir as it runs: with replica groups, checkpoints are shared in <run.dir>/checkpoints unless
    checkpoint.dir names another folder (every group resumes from it; one group writes it)."""
    if job.replicas.groups and not job.checkpoint.dir:
        return str(Path(job.run.dir) / "checkpoints")
    return job.checkpoint.dir


def data_shard(cfg: ReplicaConfig | None, dp_rank: int, dp_size: int) -> tuple[int, int]:
    """(rank, size) of this rank's data shard: each group reads its own share of every global step."""
    if cfg is None or not cfg.groups:
        return dp_rank, dp_size
    return cfg.group * dp_size + dp_rank, cfg.groups * dp_size


def probe_lighthouse(address: str, timeout_s: float) -> None:
    """Raise one clear line when nothing accepts a connection at ``address`` (host:port) within ``timeout_s``."""
    host, _, port = address.removeprefix("http://").rpartition(":")
    if not host or not port.isdecimal():
        raise ConfigError(f"replicas.lighthouse={address!r} is not host:port, e.g. 127.0.0.1:29510")
    probe = probe_tcp(host.strip("[]"), int(port), timeout_s=timeout_s, interval_s=0.2)
    if probe.ok:
        return
    raise ConfigError(f"replicas.lighthouse={address}: no lighthouse answers ({probe.error.capitalize()}) after "
                      f"{timeout_s:.0f} s (replicas.connect_timeout_s); start one there with `meshrun lighthouse "
                      f"--port {port}`, or fix the address")


class ReplicaQuorumError(RuntimeError):
    """No quorum: too few live groups, or the lighthouse is lost."""


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP, TP), or the tensor itself: rank r of every group holds the same one."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class ReplicaGroups(Stateful):
    """This group's torchft Manager and the state it hands to a healing peer; saved in checkpoints as ``replicas``
    (the manager's step and committed batches)."""

    replicated: ClassVar[bool] = True

    def __init__(self, cfg: ReplicaConfig, *, env: ProcessPlacement, device: torch.device, seed: int,
                 parts: list[nn.Module], optimizer: torch.optim.Optimizer, data: Any, scheduler: Any = None,
                 progress: Any = None):
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's per-step lines; meshrun prints quorum changes itself
        ft_log = logging.getLogger("torchft")  # its Python lines go to this rank's log file, not the console
        ft_log.handlers, ft_log.propagate = [h for h in log.handlers if isinstance(h, logging.FileHandler)], False
        try:
            from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
        except ImportError:
            raise ConfigError(f"replicas.groups={cfg.groups} needs torchft: pip install 'meshrun[ft]'") from None

        self.cfg, self.env, self.seed = cfg, env, seed
        self.parts, self.optimizer, self.data = parts, optimizer, data
        self.scheduler, self.progress = scheduler, progress
        self.params = [p for part in parts for p in part.parameters() if p.requires_grad]
        self.live_groups, self.discarded, self._first = 0, 0, False
        self.say: Callable[[str], None] = log.info
        self.record: Callable[[dict[str, Any]], None] = lambda _record: None
        if env.rank == 0:
            probe_lighthouse(cfg.lighthouse, cfg.connect_timeout_s)
        route = lighthouse_route(cfg.lighthouse)
        self.host = route.source if route else "127.0.0.1"
        if route and route.iface and device.type != "cuda":  # gloo's default device is the host name's address
            os.environ.setdefault("GLOO_SOCKET_IFNAME", route.iface)
        timeout = timedelta(seconds=cfg.timeout_s)
        self._own_store = None
        store = self._store_address()
        pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        self._pg = pg
        self.manager = Manager(
            pg=pg, load_state_dict=None, state_dict=None, min_replica_size=cfg.min_groups, use_async_quorum=False,
            timeout=timeout, quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s),
            connect_timeout=timedelta(seconds=cfg.connect_timeout_s), rank=env.rank, world_size=env.world_size,
            store_addr=store[0], store_port=store[1],
            lighthouse_addr=f"http://{cfg.lighthouse.removeprefix('http://')}",
            replica_id=f"group_{cfg.group}", hostname=self.host, init_sync=True,
            checkpoint_transport=_served_at(self.host, timeout))
        self.manager.register_state_dict_fn("meshrun", self._load_peer_state, self._peer_state)
        self._position_before = None

    def _store_address(self) -> tuple[str, int]:
        """The store the group's ranks meet in, where the other groups reach it too: the cross-group process group of
        a quorum meets in its first group's store. The launcher's, unless it listens on loopback only (`meshrun
        launch` on one host) while the lighthouse is on another host; then, as for one process without a launcher,
        rank 0 serves one on this host's address."""
        addr = self.env.master_addr
        if self.env.is_distributed and (is_loopback(self.host) or not is_loopback(addr)):
            return addr, self.env.master_port
        where: list[Any] = [None]
        if self.env.rank == 0:
            self._own_store = bound_tcp_store(self.host, 0, timeout=timedelta(seconds=self.cfg.timeout_s))
            where = [(self.host, self._own_store.port)]
        if self.env.world_size > 1:
            torch.distributed.broadcast_object_list(where, src=0)  # collective: every rank of the group
        return where[0]

    @property
    def step(self) -> int:
        """Committed steps: the manager's counter, the same in every live group."""
        return self.manager.current_step()

    def describe(self) -> str:
        c = self.cfg
        return (f"replica group {c.group} of {c.groups} (torchft): lighthouse {c.lighthouse}, at least {c.min_groups}"
                f" live group(s) per step; data shard {c.group} of {c.groups} per step")

    # ---- one step ---------------------------------------------------------------------------------------------------

    def start_step(self) -> None:
        """Quorum (blocks until the lighthouse forms one; up to the heartbeat timeout after a group is lost). A
        group that is behind is healed here, before its forward pass."""
        before = self.live_groups
        try:
            self.manager.start_quorum()  # sync quorum: heals now if this group is behind
        except Exception as exc:  # noqa: BLE001 - torchft's gRPC status, with what it means here
            c = self.cfg
            raise ReplicaQuorumError(
                f"replica group {c.group}: no quorum within replicas.quorum_timeout_s={c.quorum_timeout_s:g} s at step "
                f"{self.step + 1}: fewer than replicas.min_groups={c.min_groups} groups are alive, or the lighthouse "
                f"at {c.lighthouse} is gone (start it again with `meshrun lighthouse`; every group resumes from the "
                f"last checkpoint) [{str(exc).splitlines()[0][:120]}]") from exc
        self.live_groups = self.manager.num_participants()
        self._first = self.manager.participating_rank() == 0  # kept: a failed quorum cannot be asked any more
        if self.live_groups != before:
            self.say(f"replica groups: {self.live_groups} live at step {self.step + 1} (was {before})")
            self.record({"kind": "replicas", "step": self.step, "live_groups": self.live_groups})
        self._position_before = getattr(self.data, "position", None)

    def average_gradients(self) -> bool:
        """Average every local gradient shard over the live groups, then vote: True when every group's step
        succeeded (step the optimizer), False when one failed (the gradients are zeroed, the data rewinds).
        Collective across groups: rank r of each live group."""
        grads = [_local(p.grad) for p in self.params if p.grad is not None]
        try:
            for bucket in _buckets(grads):
                flat = torch.cat([g.reshape(-1) for g in bucket])
                self.manager.allreduce(flat).wait()  # an error is recorded by the manager, not raised
                offset = 0
                for g in bucket:
                    g.copy_(flat[offset:offset + g.numel()].view_as(g))
                    offset += g.numel()
        except Exception as exc:  # noqa: BLE001 - a failed peer: the vote below discards this step
            self.manager.report_error(exc)
        if self.manager.should_commit():
            return True
        self.discard()
        return False

    def discard(self) -> None:
        """A step that did not commit: drop its gradients and read its batch again."""
        self.discarded += 1
        self.optimizer.zero_grad(set_to_none=True)
        if self._position_before is not None:
            self.data.seek(self._position_before)
        self.say(f"replica groups: step {self.step + 1} discarded (a group failed during it); running it again")
        self.record({"kind": "replicas", "step": self.step, "discarded": True, "live_groups": self.live_groups})

    def saves_checkpoints(self) -> bool:
        """One group writes the shared checkpoints: the first live group of the last quorum (also after the
        lighthouse is lost: it saves the last committed step before stopping)."""
        return self._first

    # ---- healing: what a live group sends, what a healing group loads --------------------------------------------

    def _peer_state(self) -> dict[str, Any]:
        """This rank's local shards (rank r of the healing group holds the same layout) and the small state."""
        optim = self.optimizer.state_dict()
        optim["state"] = {k: {n: _local(v).detach() if isinstance(v, torch.Tensor) else v for n, v in s.items()}
                          for k, s in optim["state"].items()}
        return {"params": [_local(p).detach() for p in self.params],
                "buffers": [b for part in self.parts for b in part.buffers()],
                "optimizer": optim, "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "data": self.data.state_dict(), "progress": self.progress.state_dict() if self.progress else None}

    @torch.no_grad()
    def _load_peer_state(self, state: dict[str, Any]) -> None:
        for param, value in zip(self.params, state["params"], strict=True):
            _local(param).copy_(value)
        for buffer, value in zip([b for part in self.parts for b in part.buffers()], state["buffers"], strict=True):
            buffer.copy_(value)
        self.optimizer.load_state_dict(_as_dtensors(state["optimizer"], self.optimizer))
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.data.load_state_dict(state["data"])
        if self.progress is not None:
            self.progress.load_state_dict(state["progress"])
        step = int(state["progress"]["step"]) if self.progress is not None else self.manager.current_step()
        self.reseed(step)
        self.say(f"replica group {self.cfg.group}: healed from a live group at step {step} (model, optimizer, "
                 "scheduler, data position; random streams re-derived)")
        self.record({"kind": "replicas", "step": step, "healed": True})

    def reseed(self, step: int) -> None:
        """Random streams after a heal or a resume: from (seed, step) and this rank's global rank, so no two groups
        share dropout masks."""
        reseed_rng(self.seed * 1_000_003 + step, self.cfg.group * self.env.world_size + self.env.rank)

    # ---- checkpoints (Stateful) -----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {k: torch.tensor(v, dtype=torch.int64) for k, v in self.manager.state_dict().items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.manager.load_state_dict({k: int(v.item()) for k, v in state_dict.items()})
        self.reseed(self.manager.current_step())

    def close(self) -> None:
        """Stop torchft's manager, then release the cross-group process group and the store this group met in, in
        that order, while the interpreter is whole. Left to interpreter exit, their threads may be torn down in any
        order; a CI run once saw a group process end with "terminate called without an active exception" after its
        last step (not reproduced in 18 runs since, loaded or idle)."""
        self.manager.shutdown(wait=False)
        self._pg.shutdown()  # drops torchft's reference to its torch process group, which joins its threads now
        self._own_store = None


def _buckets(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Consecutive gradients of one dtype, about BUCKET_BYTES each."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for g in grads:
        if not buckets or size + g.numel() * g.element_size() > BUCKET_BYTES or buckets[-1][0].dtype != g.dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(g)
        size += g.numel() * g.element_size()
    return buckets


def _as_dtensors(state: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The peer's optimizer state with each local shard put back as a DTensor like its parameter's."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    rebuilt = {}
    for index, entry in state["state"].items():
        param = params[int(index)]
        rebuilt[index] = {k: DTensor.from_local(v, param.device_mesh, param.placements, shape=param.shape,
                                                stride=param.stride(), run_check=False)
                          if isinstance(param, DTensor) and isinstance(v, torch.Tensor) and v.dim() else v
                          for k, v in entry.items()}
    return {**state, "state": rebuilt}


def lighthouse_route(lighthouse: str) -> Route | None:
    """How this host reaches the lighthouse; None for one on loopback (every group on this host). Its source
    address is what the other groups reach this group at (torchft would advertise the host name, which resolves to
    loopback on many hosts)."""
    host = lighthouse.removeprefix("http://").rpartition(":")[0].strip("[]")
    if is_loopback(host):
        return None
    try:
        return route_to(host)
    except EndpointError as exc:
        raise ConfigError(f"replicas.lighthouse={lighthouse}: {exc}") from None


def _served_at(host: str, timeout: timedelta) -> Any:
    """torchft's HTTP transport (a healing group fetches the live state from it), named by ``host``: it listens on
    every interface but names itself by the host name."""
    from torchft.checkpointing.http_transport import HTTPTransport

    class Transport(HTTPTransport):
        def address(self) -> str:
            port = self._server.socket.getsockname()[1]
            return f"http://{f'[{host}]' if ':' in host else host}:{port}/checkpoint/"

    return Transport(timeout=timeout, num_chunks=0)
