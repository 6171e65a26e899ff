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


PIPELINE_MICROBATCH_TOKENS = 4096
"""The fewest tokens a default pipeline micro-batch carries (unless fewer are needed to fill the pipeline). Below
it the host's fixed work per micro-batch and stage outruns the GPU's: on 2x H200 (1b, 16 samples of 2048 tokens per
step, PP 2) 16 micro-batches of one sample ran 0.74x 8 of two with 1F1B (46.8k against 63.2k tokens/s per GPU) and
0.58x with interleaved 1F1B (39.5k against 68.3k, the GPUs 82% busy), although the bubble is half as large
(docs/benchmarks.md)."""


MICROBATCH_OVERHEAD_TOKENS = 1000
"""What one pipeline micro-batch costs each stage beyond its tokens, in tokens' worth of work: the schedule's host
work, the sends and receives, and matmuls too narrow to fill the GPU. Fitted to 2x H200 (1b, 16 samples of 2048
tokens per step, PP 2, interleaved 1F1B with 2 stages per rank, 2026-11-30): 4 micro-batches of 8192 tokens ran
1.045-1.047x 8 of 4096 (71.5k against 68.3k tokens/s per GPU; 0.996x of FSDP2 as the default), although the bubble
is twice as large; 16 of 2048 ran 0.58x, the host then too slow to keep the GPUs busy (docs/benchmarks.md, round
27). With 1F1B on 2 H100s 4 micro-batches had run 1.036x 8 (2026-11-27), where this cost puts them level."""


def microbatch_cost(microbatches: int, tokens: int, *, pp: int, virtual_stages: int = 1) -> float:
    """A step's time, in tokens of one stage's work, with ``tokens`` per step cut into ``microbatches``:
    ``(m + (p - 1) / v) x (tokens / m + MICROBATCH_OVERHEAD_TOKENS)``. The first factor is the schedule's slots
    with the bubble (the 1F1B family's ``(p - 1) / (v m)`` of the step), the second each slot's work."""
    return (microbatches + (pp - 1) / virtual_stages) * (tokens / microbatches + MICROBATCH_OVERHEAD_TOKENS)


def default_microbatches(samples: int, seq_len: int, *, pp: int, virtual_stages: int = 1,
                         multiple_of_pp: bool = False) -> int:
    """``parallel.pp_microbatches=0``: of the micro-batch counts that divide ``samples``, are at least ``pp`` (so
    the schedule fills the pipeline), for interleaved schedules a multiple of ``pp``, and keep at least
    :data:`PIPELINE_MICROBATCH_TOKENS` tokens each, the one with the least :func:`microbatch_cost`: a smaller bubble
    from more micro-batches against each one's fixed cost. The 1b step of 16 samples of 2048 tokens gets 4
    micro-batches on 2 ranks of 2 stages each and 8 with 1F1B on 4 ranks (whose bubble would be 3/7 of the step with
    4). Where no count keeps that many tokens, the fewest; without ``seq_len``, one per sample. When no count fits
    (fewer samples than stages) it returns ``samples`` and validation names the fix."""
    def valid(m: int) -> bool:
        return samples % m == 0 and m >= pp and (not multiple_of_pp or m % pp == 0)
    counts = [m for m in range(1, samples + 1) if valid(m)]
    if not counts:
        return samples
    if seq_len == 0:
        return max(counts)
    big_enough = [m for m in counts if samples // m * seq_len >= PIPELINE_MICROBATCH_TOKENS]
    if not big_enough:
        return min(counts)
    return min(reversed(big_enough),  # on a tie the more micro-batches: less activation memory
               key=lambda m: microbatch_cost(m, samples * seq_len, pp=pp, virtual_stages=virtual_stages))
