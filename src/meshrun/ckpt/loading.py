"""Resume: choose the checkpoint to load, verify it without redundant work, and load it without unpickling.

Choosing (collective on the checkpointer's ctl group):

* rank 0 alone walks the candidates, newest first, and runs the cheap checks (COMPLETE, manifest, file names,
  sizes, no stray or linked files); directories without COMPLETE are reported and skipped;
* the candidate is broadcast; every rank hashes its share of the files (balanced by size), and the findings are
  all-gathered, so each byte is hashed once, not once per rank;
* on a mismatch, the file is named and the previous complete checkpoint is tried, unless checkpoint.strict or
  an explicit path was asked for, which raise;
* when complete checkpoints exist but every one is damaged, the resume is refused on every rank: starting anew
  would put a new run among the earlier run's checkpoints and records (``--fresh`` moves that run aside first).
  A folder without a complete checkpoint (a job stopped before its first save) starts fresh.

What must be known before the state to load exists (the model's shape, which the checkpoint's tie state decides)
reads the same walk: :func:`peek`, the manifests of the checkpoints that pass the cheap checks, quietly; where the
answer depends on which of them the checksums let through, :func:`foresee` runs the choice quietly beforehand, and
the choice that loads takes what it found rather than hashing the files again.

Loading reads DCP's own ``.metadata`` (checked against the manifest first, and unpickled by a restricted
unpickler that refuses any global DCP's metadata does not use, see :mod:`meshrun.ckpt.safe_metadata`) to size the
JSON blobs, drops the optional entries the checkpoint lacks (RNG streams of ranks that did not exist), reads
entries an older checkpoint holds under another key from there (``MOVED_KEYS``), and a parameter that this run
trains apart from the one it was tied to, from that one's (ModelOptimState's ``tied_key``), and refuses entries
stored as pickled objects: DCP then only reads tensors, with ``torch.load(weights_only=True)``, into the Stateful
entries. A refusal to load is gathered first, so that every rank raises it, naming the rank that met it (a pipeline
stage alone may lack a key).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from meshrun.ckpt.collectives import Coordinator
from meshrun.ckpt.errors import CheckpointError
from meshrun.ckpt.folder import scan
from meshrun.ckpt.manifest import check_checksums, check_structure, data_location, share_of_files
from meshrun.ckpt.state import MOVED_KEYS, is_blob_key, walk
from meshrun.ckpt.storage import store_for

log = logging.getLogger("meshrun.ckpt")


Findings = dict[str, tuple[dict[str, Any], list[str]]]
"""Checksum problems found per checkpoint (rank 0's): path -> (its manifest then, the problems; none: sound)."""


def choose(coord: Coordinator, folder: str, *, explicit: str | None, strict: bool, verify_checksums: bool,
           threads: int, notes: list[str], known: Findings | None = None) -> tuple[str, dict[str, Any]] | None:
    """Collective. The checkpoint to load and its manifest, or None (auto, and no complete checkpoint: start fresh).
    CheckpointError on every rank where every complete checkpoint is damaged (auto), or the one that checkpoint.strict
    or an explicit path asks for is. ``known`` (rank 0's, from :func:`foresee` moments before, in the same start):
    what the checksums found in checkpoints whose manifest is still the same, taken instead of hashing them again."""
    return _choose(coord, folder, explicit=explicit, strict=strict, verify_checksums=verify_checksums,
                   threads=threads, notes=notes, say=log.warning,
                   findings=dict(known) if verify_checksums and known else {})


def foresee(coord: Coordinator, folder: str, *, explicit: str | None, strict: bool,
            threads: int) -> tuple[tuple[str, dict[str, Any]] | None, Findings]:
    """Collective. What :func:`choose` with checksums will pick, found now and quietly, for what must be known before
    the state to load exists (the model's shape); None too where it will refuse (it says why). The checksums are
    split over the ranks as choose splits them; what they found comes back (rank 0's; empty elsewhere) for the
    choose of the same start to take (``known``) instead of hashing the same files again."""
    findings: Findings = {}
    try:
        chosen = _choose(coord, folder, explicit=explicit, strict=strict, verify_checksums=True, threads=threads,
                         notes=[], say=_quiet, findings=findings)
    except CheckpointError:  # raised on every rank alike; choose raises it again, after saying what it met
        chosen = None
    return chosen, findings if coord.rank == 0 else {}


def _choose(coord: Coordinator, folder: str, *, explicit: str | None, strict: bool, verify_checksums: bool,
            threads: int, notes: list[str], say: Callable[[str], None],
            findings: Findings) -> tuple[str, dict[str, Any]] | None:
    """:func:`choose`, saying each note with ``say`` on rank 0; ``findings`` (rank 0's): checksum problems known
    already, by path, taken in place of hashing a checkpoint whose manifest is the same, and added to."""
    refusal = _refusal_hint(explicit, strict) if explicit is not None or strict else None
    candidates: list[str] = []
    pick: dict[str, Any] | None = None
    if coord.rank == 0:
        try:
            candidates = _candidates(folder, explicit, notes, say)
        except CheckpointError as exc:  # raised on every rank below, not on rank 0 alone
            pick = {"error": str(exc)}
    position = 0
    while True:
        if coord.rank == 0 and pick is None:
            pick, position = _next_sound(candidates, position, refusal=refusal, notes=notes, say=say)
            if pick is None and candidates:
                pick = {"error": _all_damaged(folder, candidates)}
            elif pick is not None and "path" in pick:
                known = findings.get(pick["path"])
                if known is not None and known[0] == pick["manifest"]:
                    pick["found"] = known[1]
        pick, notes[:] = coord.broadcast((pick, notes))
        if pick is None:
            return None
        if "error" in pick:
            raise CheckpointError(pick["error"], same_on_every_rank=True)
        path, manifest = pick["path"], pick["manifest"]
        if not verify_checksums:
            problems = []
        elif "found" in pick:  # every rank: rank 0 sent them
            problems = pick["found"]
        else:
            problems = _verify_shares(coord, path, manifest, threads)
            findings[path] = (manifest, problems)
        if not problems:
            return path, manifest
        message = f"checkpoint {path} is damaged: {'; '.join(problems)}"
        if refusal is not None:
            raise CheckpointError(message + refusal, same_on_every_rank=True)
        notes.append(message + _fallback(pick["more"]))
        if coord.rank == 0:
            say(notes[-1])
        pick = None


def peek(folder: str, explicit: str | None) -> Iterator[dict[str, Any]]:
    """The manifests of the checkpoints a resume may load, in the order it tries them (``explicit``, else the complete
    ones in ``folder``, newest first), of those that pass the cheap checks; it stops where the folder cannot be read.
    No collective, no checksums, nothing logged: for what must be known before the state to load exists (the model's
    shape); :func:`choose` then decides (:func:`foresee` tells what it will), and the load checks that the state fits
    the checkpoint it chose."""
    try:
        candidates, _ = _listed(folder, explicit)
        for _, _, manifest, problems in _checked(candidates):
            if not problems:
                yield manifest
    except Exception:  # noqa: BLE001 - choose() meets the same failure and names it
        return


_PASSED_OVER = {"incomplete": "has no COMPLETE marker", "tmp": "is an unfinished save",
                "symlink": "is a symlink (not followed)"}
"""The directories of a checkpoint folder that a resume passes over (by the kind :func:`scan` gives), and why."""


def _listed(folder: str, explicit: str | None) -> tuple[list[str], list[tuple[str, str]]]:
    """The checkpoints a resume tries, newest first (``explicit`` alone, else the complete ones in ``folder``), and the
    directories it passes over, each with why. Quiet: :func:`choose` says them, :func:`peek` does not."""
    if explicit is not None:
        return [explicit], []
    entries = scan(folder)
    passed = [(entry.path, _PASSED_OVER[entry.kind]) for entry in entries if entry.kind in _PASSED_OVER]
    return [entry.path for entry in reversed(entries) if entry.kind == "complete"], passed


def _checked(candidates: list[str], position: int = 0) -> Iterator[tuple[int, str, dict[str, Any] | None, list[str]]]:
    """Each candidate from ``position`` on, with what the cheap checks find: (index, path, manifest, problems), sound
    where problems is empty. Quiet: :func:`choose` says the problems, :func:`peek` does not."""
    for index in range(position, len(candidates)):
        path = candidates[index]
        try:
            manifest, problems = check_structure(path)
        except OSError as exc:
            manifest, problems = None, [f"{path}: cannot be read: {exc}"]
        yield index, path, manifest, problems


def _candidates(folder: str, explicit: str | None, notes: list[str], say: Callable[[str], None]) -> list[str]:
    """Rank 0: the paths to try, newest first; the directories passed over are noted."""
    if explicit is not None and not store_for(explicit).is_dir(explicit):
        raise CheckpointError(f"checkpoint.resume={explicit}: no such checkpoint directory; give a step_* "
                              "directory, 'auto' or 'none'")
    candidates, passed = _listed(folder, explicit)
    for path, why in passed:
        notes.append(f"skipped {path}: it {why}")
        say(notes[-1])
    return candidates


def _next_sound(candidates: list[str], position: int, *, refusal: str | None, notes: list[str],
                say: Callable[[str], None]) -> tuple[dict[str, Any] | None, int]:
    """Rank 0: the first candidate from ``position`` that passes the cheap checks, as a broadcastable dict."""
    for index, path, manifest, problems in _checked(candidates, position):
        more = index + 1 < len(candidates)  # a complete checkpoint older than this one is left to try
        if not problems:
            return {"path": path, "manifest": manifest, "more": more}, index + 1
        message = f"checkpoint {path} is damaged: {'; '.join(problems[:3])}"
        if refusal is not None:
            return {"error": message + refusal}, index + 1
        notes.append(message + _fallback(more))
        say(notes[-1])
    return None, len(candidates)


def _quiet(message: str) -> None:
    """Says nothing (:func:`foresee`: the choose that follows says it)."""


def _fallback(more: bool) -> str:
    """What a resume does after a damaged candidate: try the previous one, or (the oldest) nothing is left."""
    return "; falling back to the previous complete checkpoint" if more else "; no earlier complete checkpoint is left"


def _all_damaged(folder: str, candidates: list[str]) -> str:
    """Rank 0: the refusal of a resume whose every complete checkpoint (``candidates``, newest first) is damaged."""
    names = ", ".join(os.path.basename(path.rstrip("/")) for path in candidates[:3])
    more = f" and {len(candidates) - 3} more" if len(candidates) > 3 else ""
    return (f"checkpoint.resume=auto: the complete checkpoints in {folder} are all damaged ({names}{more}; each "
            "named above): nothing to resume, and a new run started here would mix with the earlier run's "
            "checkpoints and records. Start a new run with --fresh (the earlier run is moved aside) or in another "
            "--run.dir, or resume a sound copy with --checkpoint.resume=<step_* directory>")


def _refusal_hint(explicit: str | None, strict: bool) -> str:
    if explicit is not None:
        return f" (checkpoint.resume={explicit} names this checkpoint; choose another one or resume=auto)"
    return " (checkpoint.strict=true refuses to fall back; set it to false to resume from the previous one)"


def _verify_shares(coord: Coordinator, path: str, manifest: dict[str, Any], threads: int) -> list[str]:
    """Collective. Each rank hashes its share of the files; every rank gets all the findings."""
    mine = share_of_files(manifest, coord.rank, coord.size)
    found = coord.all_gather(check_checksums(data_location(path), manifest, mine, threads=threads))
    return [problem for problems in found for problem in problems]


def load_into(coord: Coordinator, state: dict[str, Any], path: str | os.PathLike) -> None:
    """Collective. Load the checkpoint at ``path`` into ``state`` (Stateful helpers or dicts of tensors).

    The Stateful entries go to ``dcp.load`` as Stateful objects: DCP fills their tensors in place and calls their
    ``load_state_dict``, so the trainer's progress and data position are restored where they live.
    """
    path = os.fspath(path)
    data = data_location(path)
    store = store_for(data)
    seen = coord.all_gather(store.exists(store.join(data, ".metadata")))
    blind = [r for r, ok in enumerate(seen) if not ok]
    if blind:
        raise CheckpointError(f"{path}: rank(s) {blind} cannot read this checkpoint's .metadata; it must be on "
                              "storage every rank mounts at the same path, or in one bucket every rank reaches",
                              same_on_every_rank=True)
    reader = store.dcp_reader(data)
    saved = reader.read_metadata().state_dict_metadata
    tree = {name: obj.state_dict() if isinstance(obj, Stateful) else obj for name, obj in state.items()}
    moved: list[tuple[str, _Moved]] = []
    try:
        targets = _load_targets(state, tree, saved, path=path, moved=moved)
        problem = None
    except CheckpointError as exc:
        problem = str(exc)
    # What a rank lacks depends on what it holds (a pipeline's last stage alone holds the output head): every rank
    # learns every rank's refusal, so that all of them raise it and none waits in DCP's load for the others.
    _raise_any(coord.all_gather(problem))
    to_load: dict[str, Any] = {name: _Targets(obj, targets[name]) if isinstance(obj, Stateful) else targets[name]
                               for name, obj in state.items()}
    # An entry an older checkpoint holds under another key is read from there: a top-level key "trainer.epoch"
    # flattens to the same DCP key as {"trainer": {"epoch": ...}}. Where another entry loads that key too (a
    # CountersState beside the StepBatches, the first name of a tied parameter on this rank), both share its tensor.
    loaded_too = dict(walk({name: _drop_moved(sub) for name, sub in targets.items() if isinstance(sub, dict)}))
    for source, target in moved:
        if source in loaded_too:
            target.tensor = loaded_too[source]
        elif source in to_load:
            target.tensor = to_load[source]
        else:
            to_load[source] = target.tensor
    try:
        dcp.load(to_load, storage_reader=reader, process_group=coord.io)
    except (Exception, CheckpointException) as exc:  # every rank gets every rank's failure from DCP
        line = store.describe_error(exc, path)  # an object store's failures as one line naming the fix
        if line is None:
            raise
        raise CheckpointError(line, same_on_every_rank=isinstance(exc, CheckpointException)) from None


def _load_targets(state: dict[str, Any], tree: dict[str, Any], saved: dict[str, Any], *, path: str,
                  moved: list[tuple[str, _Moved]]) -> dict[str, Any]:
    """This rank's load targets of every entry of ``tree`` (``state``'s state dicts); CheckpointError for a
    checkpoint this rank cannot load: a refusal of an entry's own (``load_refusal``), a key it lacks, a shape that
    differs."""
    for name, obj in state.items():
        refusal = getattr(obj, "load_refusal", None)
        reason = refusal(saved.keys(), name + ".") if refusal is not None else None
        if reason:
            raise CheckpointError(f"{path}: {reason}")
    missing: list[str] = []
    targets = {name: _prepare(sub, name + ".", saved, path=path, optional=getattr(state[name], "missing_ok", False),
                              missing=missing, moved=moved, tied=_tied_key(state[name], name + "."))
               if isinstance(sub, dict) else sub for name, sub in tree.items()}
    if missing:
        raise CheckpointError(f"{path}: has no entry for {len(missing)} key(s) this run needs, e.g. {missing[:4]}; "
                              "it was saved from a different model, optimizer or state dict")
    return targets


def _tied_key(obj: Any, prefix: str) -> Callable[[str], str | None] | None:
    """The entry's ``tied_key`` (ModelOptimState's) on whole DCP keys: where a tied checkpoint holds a key it lacks."""
    method = getattr(obj, "tied_key", None)
    if method is None:
        return None

    def tied(dotted: str) -> str | None:
        key = method(dotted.removeprefix(prefix))
        return prefix + key if key is not None else None

    return tied


def _raise_any(problems: list[str | None]) -> None:
    """Raise, on every rank, the refusal of the first rank that has one (``problems``: gathered by rank)."""
    found = [(rank, problem) for rank, problem in enumerate(problems) if problem]
    if not found:
        return
    rank, problem = found[0]
    if all(p == problem for _, p in found) and len(found) == len(problems):
        raise CheckpointError(problem, same_on_every_rank=True)
    others = f" (and {len(found) - 1} other rank(s))" if len(found) > 1 else ""
    raise CheckpointError(f"rank {rank}{others}: {problem}", same_on_every_rank=True)


class _Targets(Stateful):
    """A Stateful entry as DCP loads it: tensors sized from the checkpoint (blobs) and without the keys the
    checkpoint lacks or holds elsewhere; DCP fills them in place, then hands all of them to the entry."""

    def __init__(self, obj: Stateful, targets: dict[str, Any]):
        self.obj, self.targets = obj, targets

    def state_dict(self) -> dict[str, Any]:
        return _drop_moved(self.targets)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.obj.load_state_dict(_with_moved(self.targets))


class _Moved:
    """A target tensor the checkpoint holds under another key: an older one (see MOVED_KEYS), or a tied parameter's
    first name (``copy``: the entry gets its own copy, for the tensor may be the first name's own target)."""

    def __init__(self, tensor: torch.Tensor, *, copy: bool = False):
        self.tensor, self.copy = tensor, copy


def _drop_moved(node: dict[str, Any]) -> dict[str, Any]:
    return {k: _drop_moved(v) if isinstance(v, dict) else v for k, v in node.items() if not isinstance(v, _Moved)}


def _with_moved(node: dict[str, Any]) -> dict[str, Any]:
    return {k: _with_moved(v) if isinstance(v, dict) else _moved_tensor(v) if isinstance(v, _Moved) else v
            for k, v in node.items()}


def _moved_tensor(moved: _Moved) -> torch.Tensor:
    return moved.tensor.clone() if moved.copy else moved.tensor


def _prepare(node: dict[str, Any], prefix: str, saved: dict[str, Any], *, path: str, optional: bool,
             missing: list[str], moved: list[tuple[str, _Moved]],
             tied: Callable[[str], str | None] | None = None) -> dict[str, Any]:
    """The load targets under ``node``: blobs sized from the checkpoint, absent optional entries dropped, entries
    the checkpoint holds under another key (an older one, or, by ``tied``, a tied parameter's first name) marked
    ``_Moved`` (and listed in ``moved`` with that key)."""
    out: dict[str, Any] = {}
    for key, value in node.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            sub = _prepare(value, dotted + ".", saved, path=path, optional=optional, missing=missing, moved=moved,
                           tied=tied)
            if sub or not value:  # a branch emptied by dropped optional entries is absent, as in the checkpoint
                out[key] = sub
            continue
        source = dotted if dotted in saved or MOVED_KEYS.get(dotted) not in saved else MOVED_KEYS[dotted]
        copied = source not in saved and tied is not None and tied(dotted) in saved
        if copied:  # a tied checkpoint holds this untied parameter's state under the name it was tied to
            source = tied(dotted)
        entry = saved.get(source)
        if entry is None:
            if not optional:
                missing.append(dotted)
            continue
        if isinstance(entry, BytesStorageMetadata) or not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"{path}: entry {source!r} is stored as a pickled object; meshrun never writes "
                                  "those and refuses to unpickle one (the checkpoint is foreign or crafted)")
        if is_blob_key(dotted):
            out[key] = torch.empty(tuple(entry.size), dtype=torch.uint8)
        elif tuple(entry.size) != tuple(value.shape):
            raise CheckpointError(f"resume refused: {source} has shape {tuple(entry.size)} in {path} but "
                                  f"{tuple(value.shape)} in this run (the model configuration differs); train it in "
                                  "a new --run.dir, or start over with --fresh or --checkpoint.resume=none (Session: "
                                  "another checkpoint folder, or CheckpointConfig(resume='none'))")
        else:
            out[key] = value
        if source != dotted:
            out[key] = _Moved(out[key], copy=copied)
            moved.append((source, out[key]))
    return out
