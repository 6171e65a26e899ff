"""Process group start-up and teardown: backend and device choice, timeouts, and errors that name the address.

The first contact uses ``dist.init_timeout_s`` (short: a wrong MASTER_ADDR should fail in a minute, not after
torch's 10-30 minute defaults); once every rank is in, collectives use ``dist.timeout_s`` so that a hang during
training fails with the rank named instead of waiting forever.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from meshrun.config import ConfigError, DistConfig
from meshrun.comm.store import bind_address, bound_tcp_store
from meshrun.env import ProcessPlacement

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class DistContext:
    env: ProcessPlacement
    device: torch.device
    backend: str | None
    """None for a single process without a process group."""


def wants_cuda(cfg: DistConfig) -> bool:
    """Whether ``dist.device`` asks for a CUDA GPU (cuda, or auto where CUDA is present); known before init."""
    return cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())


def choose_device(env: ProcessPlacement, cfg: DistConfig) -> torch.device:
    """This process's device, selected (``torch.cuda.set_device``, which makes its CUDA context): its local rank's
    GPU, or the CPU (:func:`device_of`). ConfigError when it is missing."""
    device = device_of(cfg, local_rank=env.local_rank, rank=env.rank)
    if device.type == "cuda":
        torch.cuda.set_device(env.local_rank)
    return device


def device_of(cfg: DistConfig, *, local_rank: int, rank: int | None = None) -> torch.device:
    """The device of the process of ``local_rank`` on this node (GPU ``local_rank``, or the CPU) as
    :func:`choose_device` selects it, found without selecting it: no CUDA context is made. ConfigError when it is
    missing; ``rank``, the process's global rank, is named in it when given."""
    if not wants_cuda(cfg):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("dist.device='cuda' but CUDA is not available here; use --dist.device=cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        who = "" if rank is None else f"rank {rank}: "
        raise ConfigError(f"{who}local rank {local_rank} needs GPU {local_rank} but this node has {count}; use "
                          f"--nproc-per-node {count} or fewer")
    return torch.device("cuda", local_rank)


def choose_backend(device: torch.device, cfg: DistConfig) -> str:
    if cfg.backend != "auto":
        if cfg.backend == "nccl" and device.type != "cuda":
            raise ConfigError("dist.backend='nccl' needs CUDA devices; use --dist.backend=gloo on CPU")
        return cfg.backend
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(env: ProcessPlacement, cfg: DistConfig) -> DistContext:
    """Pick device and backend, and start the default process group when there is more than one process.

    Every rank must call this (it blocks until all ``env.world_size`` ranks have joined, at most
    ``cfg.init_timeout_s`` seconds).
    """
    device = choose_device(env, cfg)
    if not env.is_distributed:
        return DistContext(env=env, device=device, backend=None)
    backend = choose_backend(device, cfg)
    if dist.is_initialized():
        return DistContext(env=env, device=device, backend=dist.get_backend())
    env.check_master_address()  # SLURM direct mode: a master name that resolves to loopback fails here, not at init
    os.environ.update(env.export())  # env:// reads these; under torchrun they are already identical
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    try:
        timeout = timedelta(seconds=cfg.init_timeout_s)
        store = _own_store(env, timeout)
        dist.init_process_group(backend, init_method=None if store else "env://", store=store, rank=env.rank,
                                world_size=env.world_size, timeout=timeout, **kwargs)
        # note: a collective every rank must reach; it proves all ranks can talk before any training starts
        dist.barrier()
    except Exception as exc:  # noqa: BLE001 - re-raised with the address, the rank and the fix
        raise RuntimeError(
            f"rank {env.rank}: could not join the process group via {env.master_addr}:{env.master_port} "
            f"({backend}, world size {env.world_size}) within dist.init_timeout_s={cfg.init_timeout_s:g}s; check "
            f"that every node can reach {env.master_addr}:{env.master_port} (`meshrun doctor`) and that all "
            f"{env.world_size} ranks were started.\n  cause: {type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
        ) from exc
    _set_training_timeout(cfg.timeout_s)
    atexit.register(shutdown)  # a script that never calls shutdown()/Session.close() still exits cleanly
    return DistContext(env=env, device=device, backend=backend)


def _own_store(env: ProcessPlacement, timeout: timedelta) -> dist.Store | None:
    """The job's TCPStore, with rank 0's server listening only on MASTER_ADDR; None where torch's env:// is right.

    torch's env:// server listens on every interface. Under torchrun's agent with a shared store
    (TORCHELASTIC_USE_AGENT_STORE=True) rank 0 hosts nothing, and env:// only connects. Elsewhere rank 0 hosts the
    store here, bound to the address the other ranks connect to (loopback on one host), and the other ranks connect
    to it here too (as env:// would, but without its key prefix, which must match on every rank).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    addr = bind_address(env.master_addr) if env.rank == 0 else None
    if addr is not None:
        return bound_tcp_store(addr, env.master_port, timeout=timeout, world_size=env.world_size)
    # other ranks; or rank 0 when MASTER_ADDR is not its own address (torch's server, on every interface)
    return dist.TCPStore(env.master_addr, env.master_port, world_size=env.world_size, is_master=env.rank == 0,
                         timeout=timeout)


def _set_training_timeout(seconds: float, group: dist.ProcessGroup | None = None) -> None:
    """Set ``group``'s collective timeout (default group: switch from the init timeout to the training timeout),
    with the public ``ProcessGroup.set_timeout``."""
    group = group if group is not None else dist.group.WORLD
    try:
        group.set_timeout(timedelta(seconds=seconds))
        return
    except (AttributeError, RuntimeError):  # pragma: no cover - a torch or backend without the public setter
        pass
    # private: the only other setter torch has (it sets each backend's default timeout)
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    try:
        if setter is not None:
            setter(timedelta(seconds=seconds), group)
    except (RuntimeError, TypeError, ValueError):  # pragma: no cover - backends that do not support it
        pass


def set_mesh_timeouts(meshes: Iterable[DeviceMesh], seconds: float) -> int:
    """Give every process group of ``meshes`` the training timeout ``dist.timeout_s``: groups made after
    start-up otherwise keep torch's defaults (10 min NCCL, 30 min gloo). Returns how many groups were set."""
    groups = {id(g): g for mesh in meshes for g in mesh.get_all_groups()}
    for group in groups.values():
        _set_training_timeout(seconds, group)
    return len(groups)


def shutdown() -> None:
    """Destroy the process groups, without the exit deadlock of a gloo group last owned by a DDP model.

    torch frees a gloo group in its C++ destructor, which joins the group's worker threads while holding the GIL
    when the last owner is a DDP ``Reducer`` (freed with the user's model, after this call). A worker thread that is
    still releasing the last collective's tensors needs the GIL for that, so the process would never exit. Releasing
    the GIL for a moment first lets the workers finish; after that they are idle and any later destruction is safe.
    Registered to run at exit by :func:`init_distributed`: a group destroyed during interpreter finalization
    instead aborts the process ("terminate called without an active exception").
    """
    if not dist.is_initialized():
        return
    release_cuda_graphs()
    time.sleep(0.2)  # note: releases the GIL; see above
    dist.destroy_process_group()


def release_cuda_graphs() -> None:
    """Free the CUDA graphs torch.compile recorded (train.cuda_graphs), before the process groups go.

    NCCL's communicator destroy waits until every CUDA graph that captured one of its collectives is freed
    (pytorch#115388). TP blocks recorded as graphs hold their all-reduces, and a graph freed only at interpreter exit
    would leave destroy_process_group waiting forever: a TP run with train.cuda_graphs finished its steps on
    2 H100s and then hung. Nothing to do when no CUDA graph was recorded."""
    if "torch._inductor.cudagraph_trees" in sys.modules:
        torch.compiler.reset()  # also frees the CUDA graph trees of every device
