"""SLURM's compressed lists and the job's default port: pure string logic, no environment."""

from __future__ import annotations

import re

from meshrun.placement.process import DEFAULT_MASTER_PORT

SLURM_PORT_BASE = 15000
SLURM_PORT_SPAN = 16384
"""Ports derived from a job id lie in 15000..31383, below Linux's ephemeral range (32768 and up)."""


def slurm_port(job_id: str) -> int:
    """The rendezvous port of SLURM job ``job_id``, the same on every node: the whole id modulo 16384, so that jobs
    sharing a first node collide only when their ids differ by a multiple of 16384 (the last four digits, as
    Lightning uses, collide every 10000 jobs). ``meshrun launch`` refuses a busy port on node 0 by name."""
    digits = job_id.split("_")[0]  # array tasks ('123_4') carry their own SLURM_JOB_ID; keep the number
    return SLURM_PORT_BASE + int(digits) % SLURM_PORT_SPAN if digits.isdigit() else DEFAULT_MASTER_PORT


def expand_tasks_per_node(value: str) -> list[int]:
    """SLURM's compressed per-node task counts, one entry per node; [] when absent.

    >>> expand_tasks_per_node("2(x3),1")
    [2, 2, 2, 1]
    """
    counts: list[int] = []
    for item in filter(None, (part.strip() for part in (value or "").split(","))):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item)
        if not match:
            raise ValueError(f"SLURM task counts {value!r}: cannot read {item!r} (expected N or N(xM))")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compressed host list.

    >>> expand_nodelist("node[01-03,07],gpu5")
    ['node01', 'node02', 'node03', 'node07', 'gpu5']
    """
    hosts: list[str] = []
    for item in _split_top_level(nodelist):
        hosts.extend(_expand_item(item))
    if not hosts:
        raise ValueError(f"SLURM nodelist {nodelist!r} names no host")
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are outside brackets."""
    items, depth, current = [], 0, []
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"SLURM nodelist {text!r} has an unmatched ']'")
        if char == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth != 0:
        raise ValueError(f"SLURM nodelist {text!r} has an unmatched '['")
    items.append("".join(current))
    return [item.strip() for item in items if item.strip()]


def _expand_item(item: str) -> list[str]:
    """Expand one host pattern, which may hold several bracket groups: 'r[1-2]n[01-02]'."""
    match = re.search(r"\[([^\]]*)\]", item)
    if not match:
        return [item]
    head, tail = item[:match.start()], item[match.end():]
    expanded = []
    for part in match.group(1).split(","):
        if "-" in part:
            lo, hi = part.split("-", 1)
            width = len(lo)
            for number in range(int(lo), int(hi) + 1):
                expanded.extend(_expand_item(f"{head}{number:0{width}d}{tail}"))
        else:
            expanded.extend(_expand_item(f"{head}{part}{tail}"))
    return expanded
