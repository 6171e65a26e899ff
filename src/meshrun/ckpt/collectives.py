"""Rank coordination for checkpoints: two gloo groups of the checkpointer's own, and the small messages on them.

Why two groups: with async save a background thread finishes a checkpoint (gathers checksums, publishes) on the
``io`` group while the training thread keeps deciding ``should_save`` on the ``ctl`` group; collectives issued by
two threads on one group could be matched in a different order on different ranks and deadlock. Why gloo: the
messages are small CPU objects, DCP's async save needs a CPU backend, and the training group may be NCCL.

Every wait has the checkpointer's timeout; barriers are gloo's ``monitored_barrier``, whose error names the ranks
that did not arrive.
"""

from __future__ import annotations

import secrets
import socket
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from meshrun.ckpt.errors import CheckpointError
from meshrun.ckpt.storage import Store, store_for

SHARED_CHECK_WAIT_S = 5.0
"""How long a rank keeps looking for rank 0's probe file (network file systems cache directory lookups)."""


class Coordinator:
    """The checkpointer's ranks. Without an initialised process group: a single rank, and every call is local."""

    def __init__(self, *, process_group: dist.ProcessGroup | None = None, timeout_s: float):
        self.timeout = timedelta(seconds=timeout_s)
        self.ctl: dist.ProcessGroup | None = None
        self.io: dist.ProcessGroup | None = None
        self.rank, self.size, self.root = 0, 1, 0
        if not (dist.is_available() and dist.is_initialized()):
            return
        ranks = (dist.get_process_group_ranks(process_group) if process_group is not None
                 else list(range(dist.get_world_size())))
        # Collective: every rank of the default group creates both groups, in this order.
        self.ctl = dist.new_group(ranks, backend="gloo", timeout=self.timeout)
        self.io = dist.new_group(ranks, backend="gloo", timeout=self.timeout)
        self.rank, self.size, self.root = dist.get_rank(self.ctl), dist.get_world_size(self.ctl), ranks[0]

    @property
    def distributed(self) -> bool:
        return self.ctl is not None

    def close(self) -> None:
        """Destroy the two groups (their gloo connections to every other rank), for a Coordinator used once; every
        rank calls it. Afterwards every call is local again."""
        for group in (self.ctl, self.io):
            if group is not None:
                dist.destroy_process_group(group)
        self.ctl = self.io = None
        self.rank, self.size, self.root = 0, 1, 0

    def group(self, name: str) -> dist.ProcessGroup | None:
        return self.io if name == "io" else self.ctl

    def barrier(self, what: str, group: str = "ctl") -> None:
        """Collective. Fails after the timeout with the ranks that did not arrive named."""
        if not self.distributed:
            return
        try:
            dist.monitored_barrier(group=self.group(group), timeout=self.timeout, wait_all_ranks=True)
        except RuntimeError as exc:
            raise CheckpointError(f"{what}: not every rank arrived within {self.timeout.total_seconds():.0f}s "
                                  f"(checkpoint.timeout_s); {exc}") from None

    def broadcast(self, obj: Any, group: str = "ctl") -> Any:
        """Collective. Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.root, group=self.group(group))
        return box[0]

    def gather(self, obj: Any, group: str = "ctl") -> list[Any] | None:
        """Collective. Every rank's ``obj`` on rank 0 (by rank); None elsewhere."""
        if not self.distributed:
            return [obj]
        out = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=self.root, group=self.group(group))
        return out

    def all_gather(self, obj: Any, group: str = "ctl") -> list[Any]:
        """Collective. Every rank's ``obj`` on every rank (by rank)."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group(group))
        return out

    def all_max(self, values: list[int], group: str = "ctl") -> list[int]:
        """Collective. Element-wise maximum over ranks of small ints (one gloo all-reduce)."""
        if not self.distributed:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group(group))
        return tensor.tolist()


def check_shared_folder(coord: Coordinator, folder: str) -> None:
    """Collective. Refuse a checkpoint folder that some rank does not see as rank 0 does.

    Rank 0 checks that the store answers (an object store: within a few seconds, with the URL and what to set
    when it does not), then writes a probe file holding a random nonce; every rank looks for it (retrying a few
    seconds for network file system caches); the answers are gathered and the ranks and hosts that cannot see it
    are named. Without this, node-local folders would each receive some shards and no node would hold a whole
    checkpoint; on an object store, it catches nodes given another endpoint or bucket.
    """
    store = store_for(folder)
    nonce, failure = None, None
    if coord.rank == 0:
        nonce = secrets.token_hex(8)
        try:
            store.probe(folder)
            store.makedirs(folder)
            store.write(store.join(folder, f".shared-check-{nonce}"), nonce.encode())
            store.sync(folder)
        except CheckpointError as exc:  # the store's line names the URL already
            failure = f"checkpoint.dir={exc}" if str(exc).startswith(folder) else f"checkpoint.dir={folder}: {exc}"
        except OSError as exc:  # raised on every rank below, not on rank 0 alone
            failure = (f"checkpoint.dir={folder}: rank 0 cannot write there: "
                       f"{store.describe_error(exc, folder) or exc}")
    nonce, failure = coord.broadcast((nonce, failure))
    if failure:
        raise CheckpointError(failure, same_on_every_rank=True)
    probe = store.join(folder, f".shared-check-{nonce}")
    coord.barrier(f"checkpoint folder check of {folder}")
    seen = _sees(store, probe, nonce, SHARED_CHECK_WAIT_S if coord.rank != 0 else 0.0)
    reports = coord.all_gather((seen, socket.gethostname()))
    if coord.rank == 0:
        store.delete(probe)
    blind = [f"rank {r} on {host}" for r, (ok, host) in enumerate(reports) if not ok]
    if blind:
        raise CheckpointError(
            f"checkpoint.dir={folder} is not on storage shared by all ranks: {', '.join(blind)} cannot see the file "
            f"rank 0 on {reports[0][1]} wrote there; point checkpoint.dir at a file system that every node mounts "
            "at the same path (NFS, Lustre, GPFS, ...) or at one bucket URL with the same endpoint on every node",
            same_on_every_rank=True)


def _sees(store: Store, probe: str, nonce: str, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if store.read(probe) == nonce.encode():
                return True
        except (OSError, CheckpointError):
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)
        store.list(store.parent(probe))  # re-reading the parent defeats some clients' negative lookup cache
