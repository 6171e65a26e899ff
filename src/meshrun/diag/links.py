"""The pairwise send/recv matrix of ``meshrun bench --pairs``: the bandwidth of every rank pair, and the slowest.

All n(n-1)/2 pairs are measured in n-1 rounds (the round-robin "circle" schedule; one rank sits out each round
when n is odd): in a round every rank has one partner, and each pair sends a buffer both ways at once. Pairs of
one round run at the same time, so links that share a NIC or a switch port are measured under load, as during
training. A pair's bandwidth is the buffer size over the slower of its two ranks' mean time (GB/s, 1e9 bytes, each
direction).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshrun.diag.bench_ops import exchange
from meshrun.diag.timing import timed


def rounds(n: int) -> list[list[tuple[int, int]]]:
    """The circle method: n-1 rounds (n even) or n rounds (n odd) in which every pair of 0..n-1 meets once."""
    players = list(range(n)) + ([None] if n % 2 else [])
    m = len(players)
    schedule = []
    for _ in range(m - 1):
        pairs = [(players[i], players[m - 1 - i]) for i in range(m // 2)]
        schedule.append([(min(a, b), max(a, b)) for a, b in pairs if a is not None and b is not None])
        players = [players[0], players[-1], *players[1:-1]]  # rotate all but the first
    return schedule


@dataclass(frozen=True)
class LinkMatrix:
    size_bytes: int
    gbps: list[list[float | None]]
    """gbps[a][b]: bandwidth between ranks a and b (symmetric; None on the diagonal)."""

    def slowest(self) -> tuple[int, int, float]:
        n = len(self.gbps)
        return min(((a, b, self.gbps[a][b]) for a in range(n) for b in range(a + 1, n)), key=lambda t: t[2])


def measure_pairs(*, size_bytes: int, dtype: torch.dtype, device: torch.device, iters: int,
                  warmup: int) -> LinkMatrix:
    """Every pair of the default group, round by round. Every rank must call this (point-to-point transfers and
    collectives)."""
    n, me = dist.get_world_size(), dist.get_rank()
    count = max(1, size_bytes // dtype.itemsize)
    send = torch.ones(count, dtype=dtype, device=device)  # (count,)
    recv = torch.empty_like(send)
    mine: dict[int, float] = {}
    for pairs in rounds(n):
        partner = next((b if a == me else a for a, b in pairs if me in (a, b)), None)
        dist.barrier()  # note: collective; the pairs of a round start together
        if partner is None:
            continue
        run = lambda: exchange(send, recv, send_to=partner, recv_from=partner)  # noqa: E731
        timed(run, warmup, device)
        mine[partner] = timed(run, iters, device) / iters
    gathered: list = [None] * n
    dist.all_gather_object(gathered, mine)  # note: collective
    nbytes = count * dtype.itemsize
    gbps: list[list[float | None]] = [[None] * n for _ in range(n)]
    for a in range(n):
        for b, seconds in gathered[a].items():
            slower = max(seconds, gathered[b][a])
            gbps[a][b] = nbytes / slower / 1e9
    return LinkMatrix(size_bytes=nbytes, gbps=gbps)
