"""``meshrun report RUN_DIR [RUN_DIR ...]``: an HTML page and SVG plots of one or more runs, on the same axes.

Reads ``metrics.jsonl`` (and ``summary.json`` once a run ended), so it works on a run that is still training: it
shows what is there. The page references its plots by relative path and loads nothing from the network, so it
opens from a file:// URL, an archived folder or a CI artifact.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from meshrun.help_format import PlainHelpFormatter
from meshrun.report.compare import DEFAULT_TOLERANCE, compare
from meshrun.report.load import Run, load_run, unique_names

EPILOG = """\
examples:
  meshrun report runs/default                       # -> runs/default/report/index.html
  meshrun report runs/a runs/b --out compare/       # two runs on the same axes
  meshrun report runs/default --sample-tokens 0     # no text sample from the last checkpoint
  meshrun report --compare runs/1node runs/2node    # same loss curve? exit 0 if within --tolerance, 1 if not
"""


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="meshrun report", description=__doc__.split("\n\n")[0], epilog=EPILOG,
                                formatter_class=PlainHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (each a train run.dir)")
    p.add_argument("--out", help="folder for index.html and the plots (default: RUN_DIR/report for one run; for "
                   "several, report-A-vs-B beside the first, so no run's own page is overwritten)")
    p.add_argument("--sample-prompt", default="def ", help="prompt of the text sample (default 'def ')")
    p.add_argument("--sample-tokens", type=int, default=200,
                   help="bytes the last checkpoint of each run writes after the prompt (0: no sample; default 200)")
    p.add_argument("--open", action="store_true", help="open the page in the default browser")
    p.add_argument("--compare", action="store_true",
                   help="compare the losses of two runs (RUN_A RUN_B) at matching tokens/steps instead of drawing")
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                   help=f"largest relative loss difference that counts as agreeing (default {DEFAULT_TOLERANCE:g})")
    return p.parse_args(argv)


def draw(runs: list[Run], out: Path) -> list[tuple[str, str]]:
    """Every figure; returns (file name, caption) of those that had data."""
    from meshrun.report import plots
    from meshrun.report.system_plots import plot_system

    throughput = "tokens/s over all ranks, and MFU" if plots.has_mfu(runs) else "tokens/s over all ranks"
    figures = [(plots.plot_loss, "training (line) and validation (squares) loss against step and against tokens; "
                                 "grey dash-dot lines: restarts, grey triangles: checkpoints"),
               (plots.plot_lr, "learning rate"), (plots.plot_grad_norm, "gradient norm before clipping"),
               (plots.plot_throughput, throughput),
               (plots.plot_memory, "peak memory of the rank that used the most (axis from zero)"),
               (plots.plot_timeline, "progress against wall-clock time, with restarts and checkpoints")]
    images = []
    for plot, caption in figures:
        path = plot(runs, out)
        if path is not None:
            images.append((path.name, caption))
    for i, run in enumerate(runs):
        path = plot_system(run, out, f"system_{i}")
        if path is not None:
            images.append((path.name, f"{run.name}: each node's GPU and CPU busy time, host memory and the traffic of "
                                      "the interface NCCL/gloo use, sampled off the training thread"))
        path = plots.plot_forward(run, out, f"forward_{i}.{plots.EXT}")
        if path is not None:
            images.append((path.name, f"{run.name}: the forward passes per step on the GPU and the host's time "
                                      "issuing them (slowest rank); where the host's line reaches the GPU's, the "
                                      "GPU waited on the host"))
        path = plots.plot_rank_heatmap(run, out, f"ranks_{i}.{plots.EXT}")
        if path is not None:
            images.append((path.name, f"{run.name}: rank x step heatmap of each rank's own working time per step "
                                      "(a straggler is a bright row)"))
    return images


def sample_text(run: Run, prompt: str, tokens: int) -> str | None:
    """What the run's newest checkpoint writes after ``prompt`` (temperature 0.8, seed 0), or None without one."""
    import torch

    from meshrun.ckpt.errors import CheckpointError
    from meshrun.config import ConfigError
    from meshrun.models.generate import generate
    from meshrun.sample import find_config, load_model, resolve_checkpoint

    try:
        step_dir = resolve_checkpoint(run.path)
        model, manifest = load_model(step_dir, find_config(step_dir, None))
    except (CheckpointError, ConfigError) as exc:
        print(f"meshrun report: no text sample for {run.name}: {str(exc).splitlines()[0]}", file=sys.stderr)
        return None
    out = generate(model, list(prompt.encode()) or [10], tokens=tokens, temperature=0.8,
                   generator=torch.Generator().manual_seed(0))
    return f"[step {manifest['step']}, {step_dir.name}]\n{prompt}{bytes(out).decode('utf-8', errors='replace')}"


def write_report(run_dirs: list[Path], out: Path, *, sample_prompt: str = "def ", sample_tokens: int = 0) -> Path:
    """Read the runs, draw the figures into ``out`` and write ``out/index.html``; returns the page's path."""
    from meshrun.report.page import render

    paths = [Path(p) for p in run_dirs]
    runs = [load_run(p, name) for p, name in zip(paths, unique_names(paths))]
    out.mkdir(parents=True, exist_ok=True)
    print(f"meshrun report: {len(runs)} run(s), {sum(len(r.records) for r in runs):,} records; drawing",
          file=sys.stderr, flush=True)
    images = draw(runs, out)
    samples = {}
    for run in runs if sample_tokens > 0 else []:
        print(f"meshrun report: sampling {sample_tokens} bytes from {run.name}", file=sys.stderr, flush=True)
        text = sample_text(run, sample_prompt, sample_tokens)
        if text is not None:
            samples[run.name] = text
    page = out / "index.html"
    page.write_text(render(runs, images, samples))
    return page


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.compare:
        return compare_main(args.runs, tolerance=args.tolerance)
    out = Path(args.out) if args.out else default_out([Path(r) for r in args.runs])
    try:
        page = write_report([Path(r) for r in args.runs], out, sample_prompt=args.sample_prompt,
                            sample_tokens=args.sample_tokens)
    except (FileNotFoundError, ImportError) as exc:
        print(f"meshrun report: error: {exc}", file=sys.stderr)
        return 2
    print(page.resolve().as_uri())
    if args.open:
        import webbrowser

        webbrowser.open(page.resolve().as_uri())
    return 0


def default_out(runs: list[Path]) -> Path:
    """RUN_DIR/report for one run; for several, a folder beside the first named after all of them, so that a
    comparison never overwrites one run's own page."""
    if len(runs) == 1:
        return runs[0] / "report"
    return runs[0].resolve().parent / ("report-" + "-vs-".join(n.replace("/", "_") for n in unique_names(runs)))


def compare_main(paths: list[str], *, tolerance: float) -> int:
    """Print the comparison of two runs; 0 when they agree within ``tolerance``, 1 when not, 2 on bad input."""
    if len(paths) != 2:
        print(f"meshrun report: error: --compare takes two run directories (RUN_A RUN_B), got {len(paths)}",
              file=sys.stderr)
        return 2
    try:
        names = unique_names([Path(p) for p in paths])
        agree, lines = compare(load_run(Path(paths[0]), names[0]), load_run(Path(paths[1]), names[1]),
                               tolerance=tolerance)
    except (FileNotFoundError, ValueError) as exc:
        print(f"meshrun report: error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0 if agree else 1
