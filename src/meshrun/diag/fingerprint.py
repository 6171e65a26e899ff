"""What code and packages each process runs, and a check that all nodes run the same.

Different code on different nodes is the quietest multi-node failure: the job starts, the losses look plausible,
and the replicas slowly diverge (or one node crashes an hour in on a renamed key). A :class:`Fingerprint` is
cheap to take (no package is imported for it, git is asked with a short timeout), and
:func:`check_consistency` compares every rank's fingerprint right after the process group starts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import platform
import socket
import warnings
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch
import torch.distributed as dist

import meshrun
from meshrun.env import ProcessPlacement
from meshrun.gitstate import git_state

DEFAULT_PACKAGES = ("torch", "numpy", "triton", "transformers", "accelerate")
"""Packages whose versions are compared when installed (meshrun itself is compared by version and source hash)."""

_CODE_FIELDS = ("meshrun_source", "git", "script")
"""Fields that mean "different code" rather than "different packages"; they lead the error message."""


class FingerprintMismatch(RuntimeError):
    """Nodes run different code or packages. The first line names the node and what to sync."""


@dataclass(frozen=True)
class Fingerprint:
    """What one process runs. Every field except the identity ones must agree across the job."""

    rank: int
    node_rank: int
    host: str
    python: str
    meshrun: str
    """meshrun's version string."""
    meshrun_source: str
    """SHA-256 (hex, 16 chars) of meshrun's own .py files, so an edited checkout differs from a clean one."""
    git: str | None
    """Commit of the working directory's repository, '+dirty <hash of the diff>' when it has local changes."""
    script: str | None
    """SHA-256 (16 chars) of the entry script, when one was given."""
    torch_build: str
    """torch version with its CUDA and NCCL versions."""
    packages: dict[str, str | None] = field(default_factory=dict)
    """Installed versions of DEFAULT_PACKAGES (None: not installed)."""

    def compared(self) -> dict[str, str | None]:
        """The fields that must agree across ranks, flattened: ``{"meshrun_source": ..., "pkg:numpy": ...}``."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name not in ("rank", "node_rank", "host", "packages")}
        values.update({f"pkg:{name}": version for name, version in sorted(self.packages.items())})
        return values


def collect_fingerprint(*, env: ProcessPlacement, script: str | Path | None = None,
                        packages: tuple[str, ...] = DEFAULT_PACKAGES, cwd: str | Path | None = None) -> Fingerprint:
    """Fingerprint this process. Local only (no collective); git gets 5 s at most."""
    return Fingerprint(
        rank=env.rank, node_rank=env.node_rank, host=socket.gethostname(), python=platform.python_version(),
        meshrun=meshrun.__version__, meshrun_source=source_hash(Path(meshrun.__file__).parent),
        git=_git_text(Path.cwd() if cwd is None else Path(cwd)),
        script=file_hash(Path(script)) if script else None, torch_build=torch_build(),
        packages={name: package_version(name) for name in packages if name != "meshrun"})


@lru_cache(maxsize=8)
def source_hash(root: Path) -> str:
    """Hash of every ``*.py`` file under ``root`` (relative path and bytes), in path order."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def file_hash(path: Path) -> str:
    if not path.is_file():
        return f"missing:{path}"
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _git_text(folder: Path) -> str | None:
    state = git_state(folder)
    return None if state is None else state.describe()


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_build() -> str:
    """'2.8.0+cu128 cuda 12.8 nccl 2.27.3', or '2.8.0+cpu' without CUDA."""
    parts = [torch.__version__]
    if torch.version.cuda:
        parts.append(f"cuda {torch.version.cuda}")
        try:
            parts.append("nccl " + ".".join(map(str, torch.cuda.nccl.version())))
        except (RuntimeError, AttributeError, TypeError):  # built without NCCL
            pass
    return " ".join(parts)


@dataclass(frozen=True)
class FieldDiff:
    """One field that differs: the most common value and each node that has another."""

    name: str
    expected: str | None
    expected_nodes: tuple[int, ...]
    odd: dict[int, str | None]
    """node rank -> its (first differing) value."""
    majority: bool = True
    """Whether more than half the nodes have ``expected``. Without a majority no node is the odd one out."""

    def groups(self) -> list[tuple[str | None, tuple[int, ...]]]:
        """(value, nodes that have it), the expected group first, then the others by lowest node."""
        others: dict[str | None, list[int]] = {}
        for node, value in self.odd.items():
            others.setdefault(value, []).append(node)
        return [(self.expected, self.expected_nodes)] + [(v, tuple(nodes)) for v, nodes in others.items()]


def compare_fingerprints(fingerprints: list[Fingerprint]) -> list[FieldDiff]:
    """Fields that differ across ranks, reported per node. Pure logic: no collective.

    The expected value is the one most nodes have (node 0's on a tie). Only when more than half the nodes have it
    (``majority``) does the message point at the odd node out; two nodes that differ, or a 2/2 split, name no one.
    A node whose own ranks disagree shows its values joined by ' | '.
    """
    rows = [(fp.node_rank, fp.compared()) for fp in sorted(fingerprints, key=lambda fp: fp.rank)]
    names = list(dict.fromkeys(name for _, values in rows for name in values))
    diffs = []
    for name in names:
        if len({values.get(name) for _, values in rows}) == 1:
            continue
        per_node: dict[int, list[str | None]] = {}
        for node, values in rows:
            seen = per_node.setdefault(node, [])
            if values.get(name) not in seen:
                seen.append(values.get(name))
        node_values = {node: vals[0] if len(vals) == 1 else " | ".join(map(str, vals))
                       for node, vals in sorted(per_node.items())}
        counts = Counter(node_values.values())
        expected = next(v for v in node_values.values() if counts[v] == max(counts.values()))
        diffs.append(FieldDiff(name=name, expected=expected,
                               expected_nodes=tuple(n for n, v in node_values.items() if v == expected),
                               odd={n: v for n, v in node_values.items() if v != expected},
                               majority=2 * counts[expected] > len(node_values)))
    return diffs


def mismatch_message(diffs: list[FieldDiff], fingerprints: list[Fingerprint]) -> str:
    """First line: the most important difference and its fix. Then one line per differing field and value."""
    hosts = {fp.node_rank: fp.host for fp in sorted(fingerprints, key=lambda fp: -fp.rank)}
    code = [d for d in diffs if d.name in _CODE_FIELDS]
    lead = (code or diffs)[0]
    label = _LABELS.get(lead.name, lead.name.removeprefix("pkg:"))
    what = "code differs" if code else "package versions differ"
    ref = lead.expected_nodes[0]
    if not lead.majority:  # e.g. two nodes that differ: nothing says which one is right, so blame neither
        first = f"{what} across nodes, no majority: {_fix_all(lead)} — {_side_by_side(lead, fingerprints, hosts)}"
    elif lead.odd:
        node, value = next(iter(lead.odd.items()))
        first = (f"{what} across nodes: node {node} (host {hosts[node]}) has {label} {value}, "
                 f"node {ref} (host {hosts[ref]}) has {lead.expected}; {_fix(lead, node, fingerprints)}")
    else:  # every node agrees with itself only: ranks of one node differ (e.g. the script changed mid-launch)
        first = (f"{what} between ranks of node {ref} (host {hosts[ref]}): {label} {lead.expected}; "
                 "restart all ranks from the same files")
    lines = [first, f"  {'field':<22} {'node (host)':<28} value"]
    for diff in diffs:
        for i, (value, nodes) in enumerate(diff.groups()):
            mark = "  (expected)" if i == 0 and diff.majority else ""
            lines.append(f"  {diff.name if i == 0 else '':<22} {_nodes(nodes, hosts):<28} {value}{mark}")
    return "\n".join(lines)


_LABELS = {"meshrun_source": "meshrun source hash", "git": "git commit", "script": "entry script hash",
           "torch_build": "torch", "python": "python", "meshrun": "meshrun"}


def _fix(diff: FieldDiff, node: int, fingerprints: list[Fingerprint]) -> str:
    if diff.name in _CODE_FIELDS:
        git = next((fp.git for fp in fingerprints if fp.node_rank in diff.expected_nodes and fp.git), None)
        rev = f" (git rev {git.split()[0]})" if git else ""
        return f"sync the code{rev} on node {node}"
    if diff.name.startswith("pkg:"):
        return f"install {diff.name[4:]}=={diff.expected} on node {node}"
    if diff.name == "meshrun":
        return f"install meshrun {diff.expected} on node {node}"
    return f"use the same {_LABELS.get(diff.name, diff.name)} ({diff.expected}) on node {node}"


def _fix_all(diff: FieldDiff) -> str:
    """The fix when no value has a majority: make every node agree, without saying on which value."""
    if diff.name in _CODE_FIELDS:
        return "make the nodes run the same code (e.g. sync the checkout / same commit)"
    if diff.name.startswith("pkg:") or diff.name == "meshrun":
        return f"install the same {diff.name.removeprefix('pkg:')} version on every node"
    return f"use the same {_LABELS.get(diff.name, diff.name)} on every node"


def _side_by_side(diff: FieldDiff, fingerprints: list[Fingerprint], hosts: dict[int, str]) -> str:
    """'node 0 (host a) has X (git ...), node 1 (host b) has Y (git ...)': every group's value, none preferred.

    For a code field other than git itself, each group's git commit and dirty state follow its value, since
    "same source hash, one checkout dirty" or "two commits" is usually the quickest way to see what to sync.
    """
    label = _LABELS.get(diff.name, diff.name.removeprefix("pkg:"))
    parts = []
    for value, nodes in sorted(diff.groups(), key=lambda group: group[1][0]):
        several = len(nodes) > 1
        who = f"node{'s' if several else ''} {_nodes(nodes, hosts, host='host ')}"
        part = f"{who} {'have' if several else 'has'} {label} {value}"
        if diff.name in _CODE_FIELDS and diff.name != "git":
            gits = dict.fromkeys(fp.git for fp in sorted(fingerprints, key=lambda fp: fp.rank)
                                 if fp.node_rank in nodes)
            part += " (" + " | ".join(f"git {g}" if g else "no git checkout" for g in gits) + ")"
        parts.append(part)
    return ", ".join(parts)


def _nodes(nodes: tuple[int, ...], hosts: dict[int, str], *, host: str = "") -> str:
    """'0 (a), 2 (c)', or with ``host='host '`` '0 (host a), 2 (host c)'; three nodes at most, then '+N more'."""
    shown = ", ".join(f"{n} ({host}{hosts[n]})" for n in nodes[:3])
    return shown + (f" +{len(nodes) - 3} more" if len(nodes) > 3 else "")


def gather_fingerprints(group=None, *, env: ProcessPlacement, script: str | Path | None = None) -> list[Fingerprint]:
    """Every rank's fingerprint, on every rank. A collective every rank of ``group`` must reach."""
    mine = collect_fingerprint(env=env, script=script)
    if not (dist.is_available() and dist.is_initialized()):
        return [mine]
    gathered: list[Fingerprint | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)  # note: collective, every rank must reach it
    return [fp for fp in gathered if fp is not None]


def check_consistency(group=None, *, env: ProcessPlacement, strict: bool = True,
                      script: str | Path | None = None) -> list[Fingerprint]:
    """Compare code and package versions of every rank; raise (strict) or warn on rank 0 when they differ.

    A collective every rank of ``group`` must reach (one ``all_gather_object``). Every rank sees the same
    gathered list, so with ``strict`` every rank raises the same :class:`FingerprintMismatch` and none is
    left waiting in a later collective.
    """
    fingerprints = gather_fingerprints(group, env=env, script=script)
    diffs = compare_fingerprints(fingerprints)
    if diffs:
        message = mismatch_message(diffs, fingerprints)
        if strict:
            raise FingerprintMismatch(message)
        if env.is_rank_zero:
            warnings.warn(message, RuntimeWarning, stacklevel=2)
    return fingerprints
