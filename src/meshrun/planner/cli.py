"""``meshrun plan``: an offline look at a parallel layout before any GPU is allocated.

Given nodes, GPUs per node, a model and the parallel degrees, it prints: the world size; the global batch in the
terms B_global = B_local x (data-parallel ranks) x A; every rank's node, local rank and mesh coordinates with the
members of its TP / DP / PP groups (the same arithmetic as :class:`meshrun.comm.mesh.ParallelDims`, so the
table is what the job will build); per-GPU memory for parameters, gradients, optimizer state and activations;
tensor-parallel shard sizes; the pipeline bubble; communication volume per optimizer step for each dimension and
whether it crosses nodes; and warnings for layouts that put TP or heavy traffic on the network. ``--json`` prints
the same as JSON; ``--dry-run`` also applies the layout on a fake process group (see meshrun.parallel.dryrun).

All numbers are estimates from formulas (see docs/plan.md), not measurements.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from meshrun.config import ConfigError, ModelConfig
from meshrun.planner.args import job_from_args, parse_args
from meshrun.planner.estimate import Plan, build_plan
from meshrun.planner.render import print_plan, shown_ranks, to_json
from meshrun.planner.step_time import (DEFAULT_PEAK_TFLOPS, estimate_lines, measured_tokens_per_s, parse_count,
                                       time_estimate)
SIZE_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "seq_len")
"""The [model] fields that set its size; 0 takes the named size's value."""


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        plan = build_plan(job_from_args(args), nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                          gpu_mem_gib=args.gpu_mem_gib)
        shown_ranks(plan, args.ranks)  # validates --ranks before printing anything
        estimate, params_from = plan_time_estimate(plan, args)
    except (ConfigError, ValueError) as exc:
        print(f"meshrun plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**to_json(plan), **({"time_estimate": estimate} if estimate else {})}, indent=1))
    else:
        console = Console(width=None if sys.stdout.isatty() else 160)
        print_plan(plan, ranks=args.ranks, console=console)
        for line in estimate_lines(estimate, params_from=params_from) if estimate else []:
            console.print(line, highlight=False)
    if args.dry_run:
        return run_dry_run(plan, args)
    return 0


TIME_OPTIONS = ("params", "mfu", "peak_tflops", "tokens_per_s", "from_run")
"""The options that only shape the --tokens estimate."""


def plan_time_estimate(plan: Plan, args: argparse.Namespace) -> tuple[dict[str, Any] | None, str]:
    """(estimate, where N came from) for --tokens, or (None, '') without it. Raises ConfigError for an option of the
    estimate given without --tokens, or a throughput or peak that is not above 0."""
    if not args.tokens:
        given = [f"--{name.replace('_', '-')}" for name in TIME_OPTIONS if getattr(args, name) is not None]
        if given:
            raise ConfigError(f"{', '.join(given)} only shape{'s' if len(given) == 1 else ''} the time estimate; "
                              "give --tokens too (a token budget, e.g. --tokens 1T)")
        return None, ""
    for name in ("peak_tflops", "tokens_per_s"):
        value = getattr(args, name)
        if value is not None and not value > 0:  # `not >` also refuses nan
            raise ConfigError(f"--{name.replace('_', '-')} {value:g}: must be above 0"
                              + (" (989 for an H100's dense bf16)" if name == "peak_tflops" else ""))
    if args.from_run and args.tokens_per_s is not None:
        raise ConfigError("--from-run and --tokens-per-s both give the throughput; give only one of them")
    params, params_from = (parse_count(args.params, "--params"), "--params") if args.params else (
        float(plan.spec.count_params(plan.model)), describe_size(plan.job.model))
    throughput = measured_tokens_per_s(args.from_run) if args.from_run else args.tokens_per_s
    peak = (DEFAULT_PEAK_TFLOPS if args.peak_tflops is None else args.peak_tflops) * 1e12
    return time_estimate(params=params, tokens=parse_count(args.tokens, "--tokens"), gpus=plan.world_size,
                         peak_flops=peak, mfu=0.4 if args.mfu is None else args.mfu,
                         tokens_per_s=throughput), params_from


def describe_size(model: ModelConfig) -> str:
    """Where N comes from: the named size ('the gpt 124m size'), or the custom shape the 'model:' line shows when a
    sizing field was given (Llama-3-8B's shapes over the default name are not 'the 124m size')."""
    given = [name for name in SIZE_FIELDS if getattr(model, name)]
    if not given:
        return f"the {model.arch} {model.name} size"
    if len(given) == len(SIZE_FIELDS):
        return "the custom shape above"
    return f"the custom shape above: {', '.join(given)} given, the rest from the {model.name} size"


def run_dry_run(plan: Plan, args: argparse.Namespace) -> int:
    from rich.console import Console

    from meshrun.parallel.dryrun import default_ranks, print_rank_layout, simulate_rank

    try:
        ranks = [int(r) for r in args.dry_run_ranks.split(",") if r.strip()] or default_ranks(plan.dims)
    except ValueError:
        print(f"meshrun plan: error: --dry-run-ranks {args.dry_run_ranks!r} must be comma-separated ranks",
              file=sys.stderr)
        return 2
    console = Console(width=None if sys.stdout.isatty() else 160, stderr=args.json)
    for rank in ranks:
        if not 0 <= rank < plan.world_size:
            print(f"meshrun plan: error: --dry-run-ranks {rank} is outside world size {plan.world_size}",
                  file=sys.stderr)
            return 2
        layout = simulate_rank(plan.job, plan.model, plan.dims, rank)
        print_rank_layout(console, layout, plan.dims, gpus_per_node=plan.gpus_per_node)
    return 0
