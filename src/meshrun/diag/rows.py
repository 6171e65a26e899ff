"""The rows of ``meshrun doctor``'s check table: pass / warn / fail, what was seen, the fix, and what to run next.

Each check module returns :class:`CheckRow` objects from pure logic over facts gathered from every node; this
module prints them and ends the report with the debugging sequence: the next command for each failed check, in
the order that makes sense (network first, then clocks and devices, then GPUs' speed, then storage and data).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.markup import escape

PASS, WARN, FAIL = "pass", "warn", "fail"

ORDER = ("socket interface", "clock skew", "GPUs per node", "GPU health", "checkpoint folder", "dataset")
"""Checks in the order their failures should be debugged: one cause upstream often explains those below."""


@dataclass(frozen=True)
class CheckRow:
    check: str
    """Name of the check, one of :data:`ORDER` (it decides where its fix lands in the debugging sequence)."""
    status: str
    """pass, warn or fail."""
    detail: str
    """What was seen, naming the node(s) and host(s) that differ."""
    fix: str = ""
    """What to change (empty when it passed)."""
    next_command: str = ""
    """The command to run next to look closer (empty when it passed)."""
    hosts: tuple[str, ...] = field(default=())
    """Hosts this row blames (for tests and scripts)."""


def lines(rows: list[CheckRow]) -> list[str]:
    """One rich-markup line per row (lines, not a table: details are long and logs are narrow)."""
    colour = {PASS: "green", WARN: "yellow", FAIL: "red"}
    out = []
    for row in rows:
        fix = f" [dim]fix:[/] {escape(row.fix)}" if row.fix else ""
        out.append(f"[{colour[row.status]}]{row.status}[/] [bold]{row.check}[/]: {escape(row.detail)}{fix}")
    return out


def next_steps(rows: list[CheckRow]) -> list[str]:
    """The debugging sequence: one line per failed (then warned) check with its next command, upstream first."""
    rank = {name: i for i, name in enumerate(ORDER)}
    todo = sorted((r for r in rows if r.status != PASS and r.next_command),
                  key=lambda r: (r.status != FAIL, rank.get(r.check, len(ORDER))))
    seen: set[str] = set()
    lines = []
    for row in todo:
        if row.next_command in seen:
            continue
        seen.add(row.next_command)
        lines.append(f"{len(lines) + 1}. {row.check} ({row.status}): {row.next_command}")
    return lines


def node_label(node: int, host: str) -> str:
    return f"node {node} (host {host})"
