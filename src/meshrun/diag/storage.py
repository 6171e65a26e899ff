"""Storage checks of ``meshrun doctor``: the dataset on every node, and the checkpoint folder.

* Dataset: local rank 0 of each node looks at the path the job will read (file or folder): present, total size,
  number of files, and with ``deep`` a SHA-256 over the files' names and bytes. Nodes that differ from the
  majority are named.
* Checkpoint folder: each node creates it, writes a small probe file named after the node, and reads back the
  other nodes' probe files. Every rank writes its shards into one folder and every rank reads them all back on
  resume, so with several nodes the folder must be the same shared storage; nodes that see a different folder are
  named, grouped by what they see. Free space is compared with the estimated size of the next checkpoint. The
  folder may be an ``s3://`` or ``gs://`` URL: then each node checks that the store answers (within seconds, naming
  what to set when it does not), writes, reads back and deletes its probe object, and reads the other nodes'
  (the same bucket contents seen by all nodes); free space has no meaning there.

The collectives (``all_gather_object`` on the default group) are in :func:`check_dataset` and
:func:`check_checkpoint_folder`; every rank must call them. A single process (doctor without a launcher) checks this
host alone with :func:`check_checkpoint_folder_here` and :func:`data_facts`. The judging is pure logic.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from meshrun.ckpt.access import CONFIG_OPTIONS_IN, failure_line
from meshrun.ckpt.errors import CheckpointError
from meshrun.ckpt.storage import is_url, store_for
from meshrun.diag.gather import gather_node_facts
from meshrun.diag.rows import FAIL, PASS, CheckRow, node_label
from meshrun.env import ProcessPlacement
from meshrun.units import format_bytes

BYTES_PER_PARAM = 12
"""fp32 weights + AdamW's two fp32 moments: what a checkpoint holds per parameter (DCP writes each once)."""
_PROBE = ".meshrun-doctor-{token}-node{node}"


# ---- dataset ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DataFacts:
    node: int
    host: str
    exists: bool
    size: int = 0
    files: int = 0
    digest: str | None = None
    error: str | None = None


def data_facts(path: str, *, node: int, host: str, deep: bool) -> DataFacts:
    """What this node sees at ``path``; ``deep`` hashes every byte (SHA-256 over relative names and contents)."""
    root = Path(path)
    try:
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root] if root.is_file() else []
        if not files and not root.exists():
            return DataFacts(node=node, host=host, exists=False)
        size = sum(p.stat().st_size for p in files)
        digest = _digest(root, files) if deep else None
    except OSError as exc:
        return DataFacts(node=node, host=host, exists=root.exists(), error=f"{type(exc).__name__}: {exc}")
    return DataFacts(node=node, host=host, exists=True, size=size, files=len(files), digest=digest)


def _digest(root: Path, files: list[Path]) -> str:
    h = hashlib.sha256()
    for p in files:
        h.update(str(p.relative_to(root) if p != root else p.name).encode() + b"\0")
        with p.open("rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
    return h.hexdigest()[:16]


def judge_data(path: str, facts: list[DataFacts]) -> CheckRow:
    """One row: fail naming the nodes where the dataset is missing, unreadable or differs from the majority."""
    missing = [f for f in facts if not f.exists or f.error]
    present = [f for f in facts if f.exists and not f.error]
    key = lambda f: (f.size, f.files, f.digest)  # noqa: E731 - what "the same dataset" means here
    common = Counter(key(f) for f in present).most_common(1)
    expected = common[0][0] if common else None
    odd = [f for f in present if key(f) != expected]
    if not missing and not odd:
        deep = f", sha256 {expected[2]}" if expected and expected[2] else ""
        return CheckRow("dataset", PASS, f"{path}: {format_bytes(expected[0])} in {expected[1]} file(s) on all "
                                         f"{len(facts)} node(s){deep}")
    parts = [f"{node_label(f.node, f.host)}: {f.error or 'missing'}" for f in missing]
    parts += [f"{node_label(f.node, f.host)}: {format_bytes(f.size)} in {f.files} file(s)"
              + (f", sha256 {f.digest}" if f.digest else "") for f in odd]
    if expected is not None:
        parts.append(f"the others: {format_bytes(expected[0])} in {expected[1]} file(s)"
                     + (f", sha256 {expected[2]}" if expected[2] else ""))
    hosts = tuple(f.host for f in missing + odd)
    return CheckRow("dataset", FAIL, f"{path} differs across nodes: " + "; ".join(parts),
                    fix=f"copy the same {path} to {', '.join(sorted(set(hosts)))} (or put it on shared storage)",
                    next_command=f"ls -l {path} && sha256sum {path} on {', '.join(sorted(set(hosts)))}; "
                                 "`meshrun doctor --deep` compares checksums", hosts=hosts)


def check_dataset(env: ProcessPlacement, path: str, *, host: str, deep: bool) -> CheckRow:
    """Collective (every rank): each node's local rank 0 looks at ``path``; the row on every rank."""
    mine = data_facts(path, node=env.node_rank, host=host, deep=deep) if env.local_rank == 0 else None
    return judge_data(path, gather_node_facts(mine))


# ---- checkpoint folder -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FolderFacts:
    node: int
    host: str
    writable: bool
    error: str | None
    free: int | None
    seen: tuple[int, ...] = ()
    """Nodes whose probe file this node reads back (itself included when it could write)."""


def write_probe(folder: Path | str, token: str, node: int) -> str | None:
    """Create ``folder`` (a path or URL) and a probe file in it; the error in words, or None."""
    location = str(folder)
    try:
        store = store_for(location)
        store.probe(location, options_in=CONFIG_OPTIONS_IN)  # a store that does not answer: in seconds, what to set
        store.makedirs(location)
        store.write(store.join(location, _PROBE.format(token=token, node=node)), f"{token} {node}\n".encode())
        return None
    except CheckpointError as exc:
        return str(exc).removeprefix(f"{location}: ")
    except OSError as exc:
        line = failure_line(exc, location)
        return line.removeprefix(f"{location}: ") if line else f"cannot write there ({exc.strerror or exc})"


def seen_probes(folder: Path | str, token: str, nodes: int) -> tuple[int, ...]:
    store, location = store_for(folder), str(folder)
    found = []
    for node in range(nodes):
        try:
            data = store.read(store.join(location, _PROBE.format(token=token, node=node)))
            if data.decode(errors="replace").split() == [token, str(node)]:
                found.append(node)
        except (OSError, CheckpointError):
            pass
    return tuple(found)


def check_checkpoint_folder(env: ProcessPlacement, folder: str, *, host: str, needed: int) -> list[CheckRow]:
    """Collective (every rank): write, read back across nodes, clean up; rows on every rank."""
    token_box = [uuid.uuid4().hex[:12]]
    dist.broadcast_object_list(token_box, src=0)  # note: collective; one token for this run
    token, leader = token_box[0], env.local_rank == 0
    error = write_probe(folder, token, env.node_rank) if leader else None
    dist.barrier()  # note: collective; every node has written before anyone reads
    mine = _facts_after_writes(folder, token, node=env.node_rank, nodes=env.num_nodes, host=host,
                               error=error) if leader else None
    facts = gather_node_facts(mine)  # also: every node has read before anyone removes its file
    if leader and error is None:
        _remove_probe(folder, token, env.node_rank)
    return judge_folder(folder, facts, needed=needed)


def check_checkpoint_folder_here(folder: str, *, host: str, needed: int) -> list[CheckRow]:
    """This host alone, no process group: write a probe file (object), read it back, delete it; rows as
    :func:`judge_folder` makes them for one node."""
    token = uuid.uuid4().hex[:12]
    error = write_probe(folder, token, 0)
    facts = _facts_after_writes(folder, token, node=0, nodes=1, host=host, error=error)
    if error is None:
        _remove_probe(folder, token, 0)
        if not facts.seen:
            facts = dataclasses.replace(facts, writable=False, error="wrote a probe file but could not read it back")
    return judge_folder(folder, [facts], needed=needed)


def _facts_after_writes(folder: str, token: str, *, node: int, nodes: int, host: str,
                        error: str | None) -> FolderFacts:
    """This node's facts once every node has written its probe (or failed to): free space, and the probes of the
    ``nodes`` nodes it reads back. A node that could not write reads nothing: the folder fails anyway, and the store
    that refused it may refuse reads with errors of its own."""
    if error is not None:
        return FolderFacts(node=node, host=host, writable=False, error=error, free=None)
    return FolderFacts(node=node, host=host, writable=True, error=None, free=store_for(folder).free_bytes(folder),
                       seen=seen_probes(folder, token, nodes))


def _remove_probe(folder: str, token: str, node: int) -> None:
    store = store_for(folder)
    with contextlib.suppress(OSError):
        store.delete(store.join(folder, _PROBE.format(token=token, node=node)))


def judge_folder(folder: str, facts: list[FolderFacts], *, needed: int) -> list[CheckRow]:
    """Rows for writability and room, and (several nodes) whether every node sees the same folder."""
    rows = []
    bad = [f for f in facts if not f.writable]
    if bad:
        rows.append(CheckRow("checkpoint folder", FAIL, f"{folder}: " + "; ".join(
            f"{node_label(f.node, f.host)} {f.error}" for f in bad),
            fix="set checkpoint.dir to a folder every rank can write, or fix its permissions",
            next_command=(f"meshrun ckpt ls {folder}" if is_url(folder) else  # the store's own one-line error
                          f"touch {folder}/probe on {', '.join(f.host for f in bad)}"),
            hosts=tuple(f.host for f in bad)))
    if len(bad) < len(facts):  # room on the nodes that could write (none: no "writable" row)
        rows.append(_room_row(folder, [f for f in facts if f.writable], needed))
    if len(facts) > 1 and not bad:
        rows.append(_shared_row(folder, facts))
    return rows


def _room_row(folder: str, facts: list[FolderFacts], needed: int) -> CheckRow:
    short = [f for f in facts if f.free is not None and f.free < needed]
    if short:
        return CheckRow("checkpoint folder", FAIL, f"{folder}: the next checkpoint needs about {format_bytes(needed)}; "
                        + "; ".join(f"{node_label(f.node, f.host)} has {format_bytes(f.free)} free" for f in short),
                        fix="free space there, lower checkpoint.keep_last, or set checkpoint.dir to a larger "
                            "file system", next_command=f"df -h {folder}", hosts=tuple(f.host for f in short))
    known = [f.free for f in facts if f.free is not None]
    room = (f"at least {format_bytes(min(known))} free" if known else "an object store (no free-space limit)"
            if is_url(folder) else "free space unknown")
    if needed:
        size = f" for about {format_bytes(needed)} per checkpoint"
    else:  # an object store has no limit to compare with; a folder's free space is still worth a size
        size = "" if is_url(folder) and not known else " (checkpoint size unknown: pass --config or --ckpt-bytes)"
    return CheckRow("checkpoint folder", PASS, f"{folder}: writable, {room}{size}")


def _shared_row(folder: str, facts: list[FolderFacts]) -> CheckRow:
    views = Counter(f.seen for f in facts)
    everyone = tuple(sorted(f.node for f in facts))
    if set(views) == {everyone}:
        return CheckRow("checkpoint folder", PASS, f"{folder}: the same shared folder on all {len(facts)} nodes "
                                                   "(a file written on each node is read back on every other)")
    groups = "; ".join(f"{', '.join(node_label(f.node, f.host) for f in facts if f.seen == seen)} "
                       f"see the files of node(s) {', '.join(map(str, seen)) or 'none'}" for seen in views)
    odd_view = [seen for seen, _ in views.most_common()[1:]] or list(views)
    hosts = tuple(f.host for f in facts if f.seen in odd_view)
    return CheckRow("checkpoint folder", FAIL, f"{folder} is not the same folder on every node: {groups}",
                    fix="put checkpoint.dir on storage every node mounts (NFS, Lustre, ...): every rank writes its "
                        "shards there and every rank reads all of them on resume",
                    next_command=f"df -h {folder} and `findmnt -T {folder}` on each node", hosts=hosts)
