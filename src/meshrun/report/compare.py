"""``meshrun report --compare RUN_A RUN_B``: do two runs of one job train the same curve?

The check the multi-node guides ask for ("multi-node should match single-node"), as one command: training losses are
matched by tokens seen (so runs whose global batch differs in its split, 1 x 16 or 2 x 8, still line up step for
step), validation losses by step, and the largest relative difference |A - B| / |A| is compared with a tolerance.
A step logged twice (a restart replayed it) counts with its last value.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshrun.report.load import Run

DEFAULT_TOLERANCE = 0.01
"""1%: fp32 runs on CPU agree to about 1e-6; bf16 on GPUs drifts further over thousands of steps (raise it there)."""


@dataclass(frozen=True)
class Difference:
    what: str
    """'training loss' or 'validation loss'."""
    points: int
    """Matching points compared."""
    largest: float
    """Largest relative difference |a - b| / |a|."""
    step: int
    tokens: int | None
    a: float
    b: float


def _losses(run: Run, kind: str) -> dict[int, tuple[int, int | None, float]]:
    """{key: (step, tokens, loss)}: keyed by tokens seen for training records (by step where they lack it) and by
    step for validation."""
    found = {}
    for record in run.kind(kind):
        if not isinstance(record.get("loss"), (int, float)):
            continue
        tokens = record.get("tokens_seen")
        key = tokens if kind == "train" and isinstance(tokens, int) else record["step"]
        found[key] = (record["step"], tokens, float(record["loss"]))
    return found


def difference(a: Run, b: Run, kind: str) -> Difference | None:
    """The largest relative loss difference of ``kind`` records at matching points; None when none match."""
    la, lb = _losses(a, kind), _losses(b, kind)
    common = sorted(set(la) & set(lb))
    if not common:
        return None
    worst = max(common, key=lambda k: abs(la[k][2] - lb[k][2]) / max(abs(la[k][2]), 1e-12))
    step, tokens, va = la[worst]
    vb = lb[worst][2]
    return Difference(what="training loss" if kind == "train" else "validation loss", points=len(common),
                      largest=abs(va - vb) / max(abs(va), 1e-12), step=step, tokens=tokens, a=va, b=vb)


def compare(a: Run, b: Run, *, tolerance: float = DEFAULT_TOLERANCE) -> tuple[bool, list[str]]:
    """(agree, lines to print). Raise ValueError naming both runs when they share no logged step."""
    found = [d for d in (difference(a, b, "train"), difference(a, b, "eval")) if d is not None]
    if not found:
        raise ValueError(f"{a.name} and {b.name} share no logged step or token count: compare runs of one job "
                         "(same train.log_every and global batch)")
    lines = [f"comparing {a.name} (A) with {b.name} (B), relative difference |A - B| / |A|:"]
    for d in found:
        where = f"step {d.step}" + (f", {d.tokens:,} tokens" if d.tokens is not None else "")
        lines.append(f"  {d.what}: {d.points} matching points, largest difference {d.largest:.3g} at {where} "
                     f"(A {d.a:.6f}, B {d.b:.6f})")
    agree = all(d.largest <= tolerance for d in found)
    lines.append(f"{'agree' if agree else 'DIFFER'}: largest {max(d.largest for d in found):.3g} "
                 f"{'<=' if agree else '>'} tolerance {tolerance:g}")
    return agree, lines
