"""What the system-metrics sampler costs training: tokens/s with it off, at its default period and at 10x the rate.

Trains the same job in this process once per setting of run.system_sample_s (0 = off, 1.0 = the default, 0.1),
interleaved over --repeats rounds so that drift in the machine's speed hits every setting alike, and prints per
setting the median tokens/s of the log intervals after the first (warm-up), its ratio to the run without the sampler,
and the sampler thread's own time as a share of the wall-clock time (the time it spends reading NVML and /proc, an
upper bound of what it can take from the training thread). The limit is 0.5% of throughput at the default period.

    PYTHONPATH=src python3 benchmarks/system_sampler_cost.py                       # CPU, tiny model
    PYTHONPATH=src python3 benchmarks/system_sampler_cost.py --steps 300 --extra "--model.name=124m \\
        --train.micro_batch=16 --train.compile=true"                                 # one GPU

On a shared CPU machine the tokens/s of two identical runs differ by more than 0.5%: the thread's own share is the
number to read there; on a GPU both are. Measured on a 2-core CPU machine shared with other jobs (tiny model, 120
steps, 3 rounds): the thread took 0.031% of the wall time at 1 s and 0.29% at 0.1 s; tokens/s varied by +-50%
between identical runs there, so they say nothing at the 0.5% level.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

SETTINGS = (0.0, 1.0, 0.1)


def one_run(sample_s: float, *, steps: int, log_every: int, extra: list[str]) -> tuple[float, float]:
    """(median tokens/s after the first interval, sampler's share of the wall-clock time) of one training run."""
    from meshrun.config import load_config
    from meshrun.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as run_dir:
        job = load_config(None, [f"--run.dir={run_dir}", f"--train.steps={steps}", f"--train.log_every={log_every}",
                                 "--run.progress=lines", "--checkpoint.final=false", "--train.eval_every=0",
                                 f"--run.system_sample_s={sample_s}", *extra])
        with contextlib.redirect_stdout(io.StringIO()):  # the table alone on stdout
            trainer = Trainer(job)
            started = time.perf_counter()
            trainer.fit()
            wall = time.perf_counter() - started
        sampler = trainer.system.sampler
        trainer.close()
        rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["tokens_per_s"] for r in rows if r["kind"] == "train"][1:]
    return statistics.median(speeds), (sampler.busy_s / wall if sampler is not None else 0.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--extra", default="--data.max_bytes=400000", help="meshrun overrides for every run (one string)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    results: dict[float, list[tuple[float, float]]] = {s: [] for s in SETTINGS}
    for round_ in range(args.repeats):
        for sample_s in SETTINGS:
            results[sample_s].append(one_run(sample_s, steps=args.steps, log_every=args.log_every,
                                             extra=shlex.split(args.extra)))
            print(f"round {round_ + 1}: system_sample_s={sample_s}: {results[sample_s][-1][0]:,.0f} tok/s",
                  file=sys.stderr, flush=True)
    off = statistics.median(r[0] for r in results[0.0])
    print(f"{'run.system_sample_s':>20} {'tokens/s':>12} {'vs off':>8} {'sampler thread':>15}")
    for sample_s, rows in results.items():
        speed = statistics.median(r[0] for r in rows)
        share = statistics.median(r[1] for r in rows)
        print(f"{sample_s:>20g} {speed:>12,.0f} {speed / off:>8.4f} {100 * share:>14.3f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
