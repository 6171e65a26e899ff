"""``meshrun runs [DIR]``: one row per run directory under DIR (default ``runs``), as a table or JSON.

Status: ``finished``, ``stopped early`` (SIGTERM/SIGUSR1 or Ctrl-C, checkpoint saved), ``interrupted`` (a second
Ctrl-C, no checkpoint of the last step) and ``failed`` come from summary.json; a run without one is ``running``
while its metrics.jsonl keeps changing, and ``failed`` once it has been silent for 10 minutes (its processes died
without writing a summary).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from meshrun.help_format import PlainHelpFormatter
from meshrun.report.load import Run, is_run_dir, load_run

FIELDS = ("status", "steps", "tokens", "best_val_loss", "tokens_per_s", "layout", "parallel", "last_checkpoint_step",
          "restarts")


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


def layout_cell(parallel: Any, layout: str | None) -> str:
    """The table's layout cell: the parallelisms with their degrees and the rank count, e.g. 'PP 2 1f1b + TP 4 +
    HSDP (64 ranks)', 'DDP (2 ranks)', 'single process', from the start record's ``parallel`` entry
    (train/header.py: parallel_record). A run folder written before meshrun recorded that entry has only the
    layout line (``layout``), read by :func:`short_layout`; '-' when the start record has neither."""
    cell = _parallel_cell(parallel)
    return cell if cell is not None else short_layout(layout)


def _parallel_cell(parallel: Any) -> str | None:
    """The layout cell from a ``parallel`` entry; None when there is none, or it is not one this version reads."""
    if not isinstance(parallel, dict) or not isinstance(parallel.get("parallelisms"), list):
        return None
    try:
        parts = []
        for name in parallel["parallelisms"]:
            if name == "PP":  # 'PP 2 1f1b'
                parts.append(f"PP {int(parallel['pp'])} {parallel['pp_schedule']}")
            elif name in ("TP", "CP"):  # 'TP 4'
                parts.append(f"{name} {int(parallel[name.lower()])}")
            else:  # the data parallelism: 'DDP', 'FSDP', 'HSDP', 'FSDP-replicate'
                parts.append(str(name))
        ranks = int(parallel["world_size"])
    except (KeyError, TypeError, ValueError):
        return None
    if not parts:
        return "single process"
    return f"{' + '.join(parts)} ({ranks} {'rank' if ranks == 1 else 'ranks'})"


def short_layout(layout: str | None) -> str:
    """The layout cell read back out of the start record's line (parallel.apply.describe_layout: 'pp 2 x
    dp_replicate 1 x ... = 2 ranks; pipeline 1f1b, ... | PP 1f1b | pipeline bubble ...'), as :func:`layout_cell`
    gives it; '-' without a line. Kept only for run folders written before the start record held the layout as
    data (``parallel``): a newer run's cell comes from that, whatever wording the line has."""
    if not layout:
        return "-"
    degrees, _, rest = layout.partition(" | ")
    name = rest.partition(" | ")[0]
    found = re.search(r"= (\d+) ranks?\b", degrees)
    if not name:  # an older run's line: the degrees alone
        return degrees if found is None else f"{found.group(1)} {'rank' if found.group(1) == '1' else 'ranks'}"
    if name == "single process" or found is None:
        return name
    for dim in ("pp", "tp", "cp"):  # 'PP 1f1b' -> 'PP 2 1f1b', 'TP' -> 'TP 4'
        degree = re.search(rf"\b{dim} (\d+)\b", degrees)
        if degree:
            name = re.sub(rf"\b{dim.upper()}\b", f"{dim.upper()} {degree.group(1)}", name, count=1)
    ranks = int(found.group(1))
    return f"{name} ({ranks} {'rank' if ranks == 1 else 'ranks'})"


def render_table(rows: list[dict[str, Any]], root: Path):
    from rich.table import Table

    table = Table(title=f"runs under {root}", title_justify="left")
    for name in ("run", "status", "steps", "tokens", "best val loss", "tokens/s", "layout", "last ckpt",
                 "restarts"):
        table.add_column(name, justify="left" if name in ("run", "status", "layout") else "right")
    colors = {"finished": "green", "running": "cyan", "stopped early": "yellow", "interrupted": "yellow",
              "failed": "red"}
    for r in rows:
        table.add_row(r["run"], f"[{colors.get(r['status'], 'white')}]{r['status']}[/]", f"{r['steps']:,}",
                      f"{r['tokens']:,}", "-" if r["best_val_loss"] is None else f"{r['best_val_loss']:.4f}",
                      "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:,.0f}",
                      layout_cell(r.get("parallel"), r["layout"]),
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
