"""The operations ``meshrun bench`` times, their buffers, and nccl-tests' size and bus-bandwidth conventions.

For each operation, ``size`` is the buffer nccl-tests reports and ``busbw = algbw x factor`` (n ranks in the group):

| op | size | factor |
|---|---|---|
| allreduce | the buffer | 2(n-1)/n |
| allgather | the gathered output | (n-1)/n |
| reducescatter | the scattered input | (n-1)/n |
| alltoall | one rank's whole send buffer | (n-1)/n |
| broadcast | the buffer | 1 |
| sendrecv | the buffer each rank sends (to rank+1) and receives (from rank-1) | 1 |
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

OPS = ("allreduce", "allgather", "reducescatter", "broadcast", "alltoall", "sendrecv")


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus bandwidth factor for ``op`` on ``n`` ranks (see the module's table)."""
    if op == "allreduce":
        return 2 * (n - 1) / n
    if op in ("allgather", "reducescatter", "alltoall"):
        return (n - 1) / n
    return 1.0


def element_count(size_bytes: int, n: int, itemsize: int) -> int:
    """Elements of the reported buffer: at least n, divisible by n (gather/scatter/all-to-all chunks)."""
    return max(n, size_bytes // itemsize // n * n)


def operation(op: str, count: int, *, group, dtype: torch.dtype, device: torch.device) -> Callable[[], None]:
    """A closure that runs ``op`` once on ``group`` (None: the default group). Every rank of the group must call
    it the same number of times: it is a collective (or, for sendrecv, a ring of point-to-point transfers)."""
    n = dist.get_world_size(group)
    whole = torch.ones(count, dtype=dtype, device=device)  # (count,): the reported buffer
    chunk = torch.ones(count // n, dtype=dtype, device=device)  # (count / n,)
    if op == "allreduce":
        return lambda: dist.all_reduce(whole, group=group)
    if op == "allgather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed after 2.8
        return lambda: gather(whole, chunk, group=group)
    if op == "reducescatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(chunk, whole, group=group)
    if op == "broadcast":
        src = dist.get_global_rank(group, 0) if group is not None else 0
        return lambda: dist.broadcast(whole, src=src, group=group)
    if op == "alltoall":
        out = torch.empty_like(whole)
        return lambda: dist.all_to_all_single(out, whole, group=group)
    if op == "sendrecv":
        me = dist.get_rank(group)
        peer = lambda r: dist.get_global_rank(group, r % n) if group is not None else r % n  # noqa: E731
        received = torch.empty_like(whole)
        return lambda: exchange(whole, received, send_to=peer(me + 1), recv_from=peer(me - 1), group=group)
    raise ValueError(f"unknown op {op!r}; choose one of {', '.join(OPS)}")


def exchange(send: torch.Tensor, recv: torch.Tensor, *, send_to: int, recv_from: int, group=None) -> None:
    """Send ``send`` to global rank ``send_to`` while receiving ``recv`` from ``recv_from``, and wait for both."""
    ops = [dist.P2POp(dist.isend, send, send_to, group), dist.P2POp(dist.irecv, recv, recv_from, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
