"""The report's HTML page: one self-contained file (inline CSS, no scripts, no network) next to its SVG plots."""

from __future__ import annotations

import html
import time
from typing import Any

from meshrun.report.load import Run

COLUMNS = (("status", "status"), ("steps", "steps"), ("tokens", "tokens"), ("final_train_loss", "last train loss"),
           ("final_val_loss", "last val loss"), ("best_val_loss", "best val loss"), ("tokens_per_s", "tokens/s"),
           ("mfu", "MFU"), ("peak_mem_gib", "peak mem GiB"), ("wall_time_s", "wall time"),
           ("restarts", "restarts"), ("last_checkpoint_step", "last checkpoint"), ("exit_reason", "why it ended"))

CSS = """body{font-family:sans-serif;margin:1.5em;color:#222}table{border-collapse:collapse;font-size:14px}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#eee}td.text{text-align:left}
img{max-width:100%;border:1px solid #ddd;margin:4px 0}pre{background:#f6f6f6;padding:8px;white-space:pre-wrap}
.layout,.config{font-family:monospace;font-size:13px}figcaption{font-size:13px;color:#555}
figure{display:inline-block;vertical-align:top;margin:0.6em 1em 0.6em 0;max-width:100%}"""


def fmt(key: str, value: Any) -> str:
    """A summary value as the page shows it (losses to 4 decimals, counts with separators)."""
    if value is None:
        return "-"
    if key == "mfu":
        return f"{100 * value:.1f}%"
    if key == "wall_time_s":
        return f"{value / 60:.1f} min" if value >= 60 else f"{value:.1f} s"
    if key in ("tokens", "steps", "tokens_per_s"):
        return f"{value:,.0f}"
    if isinstance(value, float):
        return f"{value:.4f}" if "loss" in key else f"{value:.3g}"
    return str(value)


def summary_table(runs: list[Run]) -> str:
    """One row per run. No MFU column where no run knows its device's peak (CPU runs)."""
    columns = [(key, label) for key, label in COLUMNS
               if key != "mfu" or any(run.summary.get("mfu") is not None for run in runs)]
    head = "<tr><th>run</th>" + "".join(f"<th>{html.escape(label)}</th>" for _, label in columns) + "</tr>"
    rows = []
    for run in runs:
        cells = [f'<td class="text">{html.escape(run.name)}</td>']
        for key, _ in columns:
            value = run.summary.get(key)
            css = "text" if key in ("status", "exit_reason") else "num"
            exact = f' data-value="{html.escape(repr(value))}"' if isinstance(value, (int, float)) else ""
            cells.append(f'<td class="{css} {key}"{exact}>{html.escape(fmt(key, value))}</td>')
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return f'<table class="summary">{head}{"".join(rows)}</table>'


def layout_block(run: Run) -> str:
    """The run's layout and global batch as written in the docs: world size = N x G, B_global = B_local x G x N x A."""
    starts = run.kind("start")
    if not starts:
        return f"<p>{html.escape(run.name)}: no start record yet.</p>"
    s = starts[-1]
    nodes, world = s.get("nodes", 1), s.get("world_size", 1)
    lines = [f"{run.name} ({run.path})",
             f"world size {world} = {nodes} node(s) x {world // max(1, nodes)} process(es) per node",
             f"layout: {s.get('layout', '?')}",
             f"global batch B_global = B_local x G x N x A: {s.get('batch_formula', '?')}",
             f"tokens per step: {s.get('tokens_per_step', 0):,}; model {s.get('model', '?')}, "
             f"{s.get('params', 0) / 1e6:.2f}M parameters on {s.get('device', '?')}",
             f"starts: {len(starts)} (restarts/resumes at step(s) "
             f"{', '.join(str(x.get('step')) for x in starts[1:]) or 'none'})"]
    for slow in run.kind("slowdown"):  # run.profile_on_slowdown
        step, steps, recorded = slow.get("step", 0), slow.get("steps", 1), slow.get("profile_steps")
        where = f"traces in {run.path}/profile/slowdown_{recorded[0]}-{recorded[1]}/" if recorded else "not profiled"
        lines.append(f"slowdown: steps {step - steps + 1}-{step} took {1e3 * slow.get('step_s', 0.0):.1f} ms each "
                     f"against a median of {1e3 * slow.get('median_step_s', 0.0):.1f} ms; {where}")
    return '<pre class="layout">' + "\n".join(html.escape(line) for line in lines) + "</pre>"


def config_block(run: Run) -> str:
    """The run's resolved config.toml, folded (what ``meshrun train`` trained with)."""
    path = run.path / "config.toml"
    text = path.read_text() if path.is_file() else "(no config.toml in the run directory)"
    return (f"<details open><summary>{html.escape(run.name)}: {html.escape(str(path))}</summary>"
            f'<pre class="config">{html.escape(text)}</pre></details>')


def render(runs: list[Run], images: list[tuple[str, str]], samples: dict[str, str]) -> str:
    """The page: summary table, each run's layout, the figures (``(file, caption)``), then text samples."""
    names = ", ".join(run.name for run in runs)
    parts = [f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>meshrun report: {html.escape(names)}"
             f"</title><style>{CSS}</style></head><body>",
             f"<h1>meshrun report: {html.escape(names)}</h1>",
             f"<p>Written {time.strftime('%Y-%m-%d %H:%M:%S')} from what the run directories held then; "
             "run <code>meshrun report</code> again to refresh a run that is still going.</p>",
             "<h2>Summary</h2>", summary_table(runs), "<h2>Layout and batch</h2>",
             *(layout_block(run) for run in runs), "<h2>Curves</h2>"]
    for file, caption in images:
        parts.append(f'<figure><img src="{html.escape(file)}" alt="{html.escape(caption)}">'
                     f"<figcaption>{html.escape(caption)}</figcaption></figure>")
    parts += ["<h2>Config</h2>", *(config_block(run) for run in runs)]
    if samples:
        parts.append("<h2>What the model writes</h2>")
        for name, text in samples.items():
            parts.append(f"<h3>{html.escape(name)}</h3><pre>{html.escape(text)}</pre>")
    parts.append("</body></html>")
    return "\n".join(parts)
