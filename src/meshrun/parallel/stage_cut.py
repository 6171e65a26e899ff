"""Where the pipeline cuts the blocks: an even block count per stage, or blocks balanced by estimated cost.

Every stage runs its blocks; the first stage also runs the token embedding (a lookup, no matmul) and the last the
final norm, the output head and the loss. With a 50k vocabulary the head's matmul alone weighs about as much as
1.75 blocks of the 1b model (6 d V against 6 x 12 d^2-ish FLOPs per token, see the ModelSpec's
``flops_per_token``), so an even cut leaves the last stage the slowest and every other stage waiting for it each
micro-batch. ``parallel.pp_balance=cost`` (the default) moves blocks off the last stage until the estimated costs
are as even as whole blocks allow; ``blocks`` keeps the even cut (extra blocks on the earlier stages).

Costs come from the spec's formulas, not from a measurement: a block is ``(flops(L) - flops(0)) / L`` per token
and the work outside the blocks, ``flops(0)`` (the head for a Llama-style model), is counted on the last stage.
The cut changes which stage holds a block, never its name: blocks keep their global index ("layers.7...") on
every cut, so a checkpoint saved with one cut loads into another (DCP matches tensors by name).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from meshrun.comm.mesh import ParallelDims
    from meshrun.models.shape import ModelShape
    from meshrun.models.spec import ModelSpec


def even_counts(n_layers: int, n_stages: int) -> list[int]:
    """Blocks per stage for an even cut: sizes differ by at most one, the extra blocks on the earlier stages."""
    base, extra = divmod(n_layers, n_stages)
    return [base + (1 if stage < extra else 0) for stage in range(n_stages)]


def ranges_of(counts: Sequence[int]) -> list[range]:
    """Contiguous block indices of each stage from its block count."""
    ranges, start = [], 0
    for size in counts:
        ranges.append(range(start, start + size))
        start += size
    return ranges


def edge_costs(spec: ModelSpec, shape: ModelShape) -> tuple[float, float]:
    """(first stage, last stage) work outside the blocks, in blocks: the spec's ``flops_per_token`` of the model
    without blocks (the embedding lookup has no matmul; the head, counted on the last stage, does)."""
    outside = spec.flops_per_token(replace(shape, n_layers=0))
    block = (spec.flops_per_token(shape) - outside) / shape.n_layers
    return 0.0, (outside / block if block > 0 else 0.0)


def balanced_counts(n_layers: int, n_stages: int, *, first: float = 0.0, last: float = 0.0) -> list[int]:
    """Blocks per stage (each at least one) minimising the costliest stage, where a stage costs its blocks plus
    ``first`` / ``last`` on the first / last stage; ties go to the smaller spread, then to more blocks earlier.
    The middle stages (same cost per block) take an even share of what the two ends leave."""
    if n_stages == 1:
        return [n_layers]
    middle = n_stages - 2
    best: tuple | None = None
    for head in range(1, n_layers - n_stages + 2):
        for tail in range(1, n_layers - head - middle + 1):
            rest = n_layers - head - tail
            if (middle == 0 and rest) or rest < middle:
                continue
            counts = [head, *(even_counts(rest, middle) if middle else []), tail]
            costs = [head + first, *counts[1:-1], tail + last]
            key = (max(costs), sum(c * c for c in costs), [-c for c in counts])
            if best is None or key < best[0]:
                best = (key, counts)
    assert best is not None  # n_layers >= n_stages is checked before (ParallelDims.validate_model)
    return best[1]


def stage_shares(counts: Sequence[int], *, first: float = 0.0, last: float = 0.0) -> list[float]:
    """Each stage's estimated share of the step's work."""
    costs = [float(c) for c in counts]
    costs[0] += first
    costs[-1] += last
    total = sum(costs)
    return [c / total for c in costs]


def resolve_cut(spec: ModelSpec, shape: ModelShape, n_stages: int, balance: str) -> tuple[list[int], list[float]]:
    """(blocks per stage, estimated cost share per stage) for ``parallel.pp_balance``."""
    first, last = edge_costs(spec, shape)
    if balance == "blocks":
        counts = even_counts(shape.n_layers, n_stages)
    else:
        counts = balanced_counts(shape.n_layers, n_stages, first=first, last=last)
    return counts, stage_shares(counts, first=first, last=last)


def stage_ranges(dims: ParallelDims, n_layers: int) -> list[range]:
    """The block indices of every stage of ``dims``: its resolved cut (ParallelDims.pp_layers, set when the dims
    were checked against a model), else an even cut."""
    counts = list(dims.pp_layers) if dims.pp_layers else even_counts(n_layers, dims.stages)
    return ranges_of(counts)


def describe_cut(counts: Sequence[int], shares: Sequence[float]) -> str:
    """'blocks 10+8 (est. cost 49%/51%)' for the layout line."""
    return f"blocks {'+'.join(map(str, counts))} (est. cost {'/'.join(f'{s:.0%}' for s in shares)})"


PIPELINE_MICROBATCH_TOKENS = 8192
"""The fewest tokens a default pipeline micro-batch carries. Each micro-batch costs a fixed host and point-to-point
overhead per stage, and small micro-batches run the matmuls less efficiently; both outweigh the bubble that more
micro-batches save. On 2x H200 (1b, 16 samples of 2048 tokens per step, PP 2): with 1F1B, 16 micro-batches of one
sample ran 46.8k tokens/s per GPU and 8 of two samples 63.2k; with interleaved 1F1B (2 stages per rank), 4 of four
samples ran 71.5k (0.99x of FSDP2 in the same call), 8 of two 68.3k and 16 of one 39.5k, although the bubble
(p - 1) / (v m) is 12%, 6% and 3% (docs/benchmarks.md)."""


def default_microbatches(samples: int, seq_len: int, *, pp: int, multiple_of_pp: bool = False) -> int:
    """``parallel.pp_microbatches=0``: the most micro-batches that divide ``samples`` and keep at least
    :data:`PIPELINE_MICROBATCH_TOKENS` tokens each (one per sample when ``seq_len`` is 0), but never fewer than
    ``pp`` while ``samples`` allows it, so the schedule fills the pipeline; a multiple of ``pp`` for interleaved
    schedules. When no count fits (fewer samples than stages) it returns ``samples`` and validation names the fix."""
    def valid(m: int) -> bool:
        return samples % m == 0 and m >= pp and (not multiple_of_pp or m % pp == 0)
    counts = [m for m in range(1, samples + 1) if valid(m)]
    if not counts:
        return samples
    big_enough = [m for m in counts if seq_len == 0 or samples // m * seq_len >= PIPELINE_MICROBATCH_TOKENS]
    return max(big_enough) if big_enough else min(counts)
