"""``meshrun runs [DIR]``: one row per run directory under DIR (default ``runs``), as a table or JSON.

Status: ``finished``, ``stopped early`` (SIGTERM/SIGUSR1 or Ctrl-C, checkpoint saved), ``interrupted`` (a second
Ctrl-C, no checkpoint of the last step) and ``failed`` come from summary.json; a run without one is ``running``
while its metrics.jsonl keeps changing, and ``failed`` once it has been silent for 10 minutes (its processes died
without writing a summary).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from meshrun.help_format import PlainHelpFormatter
from meshrun.report.load import Run, is_run_dir, load_run

FIELDS = ("status", "steps", "tokens", "best_val_loss", "tokens_per_s", "layout", "last_checkpoint_step", "restarts")


def find_runs(root: Path) -> list[Path]:
    """``root`` itself if it is a run directory, else the run directories up to two levels below it, by name."""
    if is_run_dir(root):
        return [root]
    found = [p for p in root.glob("*") if p.is_dir() and is_run_dir(p)]
    found += [p for p in root.glob("*/*") if p.is_dir() and is_run_dir(p)]
    return sorted(found)


def row(run: Run) -> dict[str, Any]:
    """The JSON row of one run: its path and the summary fields ``runs`` shows (and the exit reason)."""
    s = run.summary
    return {"run": str(run.path), **{key: s.get(key) for key in FIELDS}, "exit_reason": s.get("exit_reason")}


def render_table(rows: list[dict[str, Any]], root: Path):
    from rich.table import Table

    table = Table(title=f"runs under {root}", title_justify="left")
    for name in ("run", "status", "steps", "tokens", "best val loss", "tokens/s", "layout", "last ckpt",
                 "restarts"):
        table.add_column(name, justify="left" if name in ("run", "status", "layout") else "right")
    colors = {"finished": "green", "running": "cyan", "stopped early": "yellow", "interrupted": "yellow",
              "failed": "red"}
    for r in rows:
        degrees, _, name = (r["layout"] or "-").partition(" | ")  # 'pp 1 x ... = 2 ranks', 'DDP'
        table.add_row(r["run"], f"[{colors.get(r['status'], 'white')}]{r['status']}[/]", f"{r['steps']:,}",
                      f"{r['tokens']:,}", "-" if r["best_val_loss"] is None else f"{r['best_val_loss']:.4f}",
                      "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:,.0f}",
                      f"{name} ({degrees.rpartition('= ')[2]})" if name else degrees,
                      "-" if r["last_checkpoint_step"] is None else str(r["last_checkpoint_step"]),
                      str(r["restarts"]))
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="meshrun runs", description=__doc__.split("\n\n")[0],
                                formatter_class=PlainHelpFormatter)
    p.add_argument("dir", nargs="?", default="runs", help="folder holding run directories (default: runs)")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    root = Path(args.dir)
    if not root.is_dir():
        print(f"meshrun runs: error: {root}: no such folder; give the folder your run.dir values live in "
              "(default runs/)", file=sys.stderr)
        return 2
    rows = [row(load_run(path, str(path))) for path in find_runs(root)]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 140)
    if not rows:
        console.print(f"no run directories (with metrics.jsonl) under {root}")
        return 0
    console.print(render_table(rows, root))
    return 0
