"""``meshrun report RUN_DIR [RUN_DIR ...]``: an HTML page and PNGs of one or more runs, compared on the same axes.

Reads ``metrics.jsonl`` (and ``summary.json`` once a run ended), so it works on a run that is still training: it
shows what is there. The page references its PNGs by relative path and loads nothing from the network, so it
opens from a file:// URL, an archived folder or a CI artifact.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from meshrun.help_format import PlainHelpFormatter
from meshrun.report.load import Run, load_run, unique_names

EPILOG = """\
examples:
  meshrun report runs/default                       # -> runs/default/report/index.html
  meshrun report runs/a runs/b --out compare/       # two runs on the same axes
  meshrun report runs/default --sample-tokens 0     # no text sample from the last checkpoint
"""


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="meshrun report", description=__doc__.split("\n\n")[0], epilog=EPILOG,
                                formatter_class=PlainHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (each a train run.dir)")
    p.add_argument("--out", help="folder for index.html and the PNGs (default: RUN_DIR/report of the first run)")
    p.add_argument("--sample-prompt", default="def ", help="prompt of the text sample (default 'def ')")
    p.add_argument("--sample-tokens", type=int, default=200,
                   help="bytes the last checkpoint of each run writes after the prompt (0: no sample; default 200)")
    p.add_argument("--open", action="store_true", help="open the page in the default browser")
    return p.parse_args(argv)


def draw(runs: list[Run], out: Path) -> list[tuple[str, str]]:
    """Every figure; returns (file name, caption) of those that had data."""
    from meshrun.report import plots

    figures = [(plots.plot_loss, "training and validation loss against step and against tokens"),
               (plots.plot_lr, "learning rate"), (plots.plot_throughput, "tokens/s over all ranks, and MFU"),
               (plots.plot_memory, "peak memory of the rank that used the most"),
               (plots.plot_timeline, "progress against wall-clock time, with restarts and checkpoints")]
    images = []
    for plot, caption in figures:
        path = plot(runs, out)
        if path is not None:
            images.append((path.name, caption))
    for i, run in enumerate(runs):
        path = plots.plot_rank_heatmap(run, out, f"ranks_{i}.png")
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
    out = Path(args.out) if args.out else Path(args.runs[0]) / "report"
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
