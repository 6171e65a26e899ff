"""Save and resume sharded checkpoints: when to save, how a save becomes durable and visible, which one to resume.

A save, on every rank (the checkpointer's methods are collectives over its ranks; call them at the same steps):

1. wait for the previous save (at most one in flight); check that every rank arrived and agrees on the step
   and on the state that DCP stores once for all (counters, scheduler, metrics);
2. DCP writes every rank's shard into the save's attempt folder (``.step_N.tmp-<id>/``, fsync'd, on a local
   folder; ``step_N/attempt-<id>/`` on an object store; rank 0 adds DCP's ``.metadata``), from the training
   thread (sync) or, after staging to CPU, from a background thread (``checkpoint.async_save``);
3. each rank hashes the files it wrote; rank 0 gathers the sizes and SHA-256s, writes ``manifest.json``, and
   publishes (:meth:`meshrun.ckpt.storage.Store.publish`): ``COMPLETE`` last, then the rename to ``step_N/``
   (local), or ``step_N/COMPLETE`` naming the attempt, created only where absent (object store); then it applies
   retention. The outcome is broadcast, so a failure raises on every rank.

So a checkpoint is trusted only once its COMPLETE exists, and a job killed at any point leaves the previous
checkpoint as the newest complete one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from meshrun.ckpt import loading
from meshrun.ckpt.collectives import Coordinator, check_shared_folder
from meshrun.ckpt.errors import CheckpointError
from meshrun.ckpt.folder import MANIFEST, complete_steps, scan, step_dir_name, steps_to_keep
from meshrun.ckpt.manifest import build_manifest, check_structure, code_version, describe_files, write_durable
from meshrun.ckpt.preemption import PreemptionFlag, signal_label
from meshrun.ckpt.run_config import describe_changes, saved_config
from meshrun.ckpt.space import check_room, describe_failure, payload_bytes
from meshrun.ckpt.staging import StagingWriter as _StagingWriter
from meshrun.ckpt.state import walk
from meshrun.ckpt.storage import register_options, store_for
from meshrun.ckpt.write_digest import DigestingFileSystem, digesting
from meshrun.config import CheckpointConfig
from meshrun.env import ProcessPlacement
from meshrun.units import format_bytes

log = logging.getLogger("meshrun.ckpt")
_SHARD_RE = re.compile(r"^__(\d+)_\d+\.distcp$")


@dataclass
class _SaveJob:
    step: int
    tmp: str
    """The attempt folder the save writes into (a path or URL), published as the step's checkpoint."""
    meta: dict[str, Any]
    final: bool
    kinds: dict[str, str]
    started: float
    needed: int = 0
    """Estimated bytes of the whole checkpoint (tensor data of every rank), for the no-space message."""
    timings: dict[str, float] = field(default_factory=dict)
    written: DigestingFileSystem | None = None
    """The writer's file system, holding the SHA-256 of each file as it was written."""


def default_io_threads(local_world_size: int) -> int:
    """Files per rank, written and hashed on as many threads: SHA-256 runs at ~1 GB/s per core, so one file per rank
    would make hashing as slow as the write. This rank's share of the node's cores (``local_world_size`` ranks on
    it), up to 4."""
    return max(1, min(4, (os.cpu_count() or 1) // max(1, local_world_size)))


class Checkpointer:
    """Sharded checkpoints of one training job in ``folder``.

    Construct it on every rank of the default process group (it creates two gloo groups, a collective).
    ``layout`` (the parallel degrees) and ``config_fingerprint`` go into each manifest; ``preemption`` (from
    :func:`install_sigterm_handler`) makes ``should_save`` stop the job on SIGTERM.
    """

    def __init__(self, cfg: CheckpointConfig, *, folder: Path | str, env: ProcessPlacement, layout: dict[str, Any],
                 config_fingerprint: str, process_group: Any = None, preemption: PreemptionFlag | None = None,
                 verify_checksums: bool = True, io_threads: int | None = None):
        self.cfg = cfg
        self.folder = os.fspath(folder)
        """The checkpoint folder: a path, or an ``s3://`` / ``gs://`` URL."""
        register_options(self.folder, getattr(cfg, "storage_options", None))
        self.store = store_for(self.folder)  # refuses a URL whose client is not installed
        self.env = env
        self.layout = dict(layout)
        self.config_fingerprint = config_fingerprint
        self.preemption = preemption
        self.verify_checksums = verify_checksums
        self.io_threads = io_threads or default_io_threads(env.local_world_size)
        self.coord = Coordinator(process_group=process_group, timeout_s=cfg.timeout_s)
        self.code = code_version() if self.coord.rank == 0 else {}
        self.stop_requested = False
        """Set (on every rank alike) by should_save once any rank got SIGTERM: save, then leave the loop."""
        self.notes: list[str] = []
        """What the last load reported: skipped or damaged checkpoints, world-size and config changes."""
        self.config: dict[str, Any] | None = None
        """This run's resolved config (as saved in manifests' meta.config): a changed fingerprint names the options."""
        """Seconds of the last finished save on this rank: stall, write, hash, total."""
        self._started = time.time()
        self._last_save_time = time.monotonic()
        self._last_step: int | None = None
        self._folder_checked = False
        self._published: set[int] = set()
        """Steps this Checkpointer published (rank 0), to tell its own directories from earlier runs'."""
        self._pending: Future | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="meshrun-ckpt") if cfg.async_save else None
        self._writer: _StagingWriter | None = None

    # ------------------------------------------------------------------ when
    def should_save(self, step: int) -> bool:
        """Whether to save after ``step``: every interval_steps, when interval_minutes have passed (rank 0's clock
        decides), and on SIGTERM when checkpoint.final is on (then ``stop_requested`` is set too).

        Collective (one small gloo all-reduce) when interval_minutes > 0 or a preemption flag is watched; call it
        at every step on every rank.
        """
        by_steps = self.cfg.interval_steps > 0 and step % self.cfg.interval_steps == 0
        by_time = False
        if self.cfg.interval_minutes > 0 or self.preemption is not None:
            due = (self.coord.rank == 0 and self.cfg.interval_minutes > 0
                   and time.monotonic() - self._last_save_time >= self.cfg.interval_minutes * 60)
            signalled = self.preemption is not None and self.preemption.is_set()
            due_all, signalled_all = self.coord.all_max([int(due), int(signalled)])
            by_time = bool(due_all)
            if signalled_all and not self.stop_requested:
                self.stop_requested = True
                if self.coord.rank == 0:
                    name = self.preemption.signal_name if self.preemption.is_set() else None
                    log.warning("%s received: %s at step %d and stopping", signal_label(name) if name else
                                "stop signal (SIGTERM, SIGUSR1: preemption, time limit; or Ctrl-C) on another rank",
                                "saving a final checkpoint" if self.cfg.final else "not saving (checkpoint.final is off)",
                                step)
        return by_steps or by_time or (self.stop_requested and self.cfg.final)

    # ------------------------------------------------------------------ save
    def save(self, step: int, state: dict[str, Any], *, meta: dict[str, Any] | None = None,
             final: bool = False) -> None:
        """Save ``state`` (Stateful helpers or dicts of tensors) as step ``step``. Collective.

        Sync (default, and always when ``final``): returns once the checkpoint is published. Async: returns after
        staging to CPU; writing, hashing and publishing go on in the background, and the next save, ``wait()`` or
        ``close()`` waits for them (raising their error, if any). A second save of the same step is skipped.
        ``meta`` (JSON-able) goes into the manifest; its ``epoch`` and ``tokens_seen`` are shown by ``ckpt ls``.
        """
        self.wait()
        if step == self._last_step:
            log.info("step %d is already saved; not saving it again", step)
            return
        started = time.perf_counter()
        meta = dict(meta or {})
        json.dumps(meta)  # a TypeError here names the offending value before any rank writes a byte
        self._ensure_folder_checked()
        tree, kinds = _materialize(state)
        self._check_agreement(step, state, tree)
        job = self._new_job(step, tree, meta=meta, final=final, kinds=kinds, started=started)
        self._last_save_time = time.monotonic()
        if self.cfg.async_save and not final:
            writer = self._staging_writer()
            job.written = writer.fs
            upload = dcp.async_save(tree, checkpoint_id=job.tmp, storage_writer=writer, process_group=self.coord.io)
            job.timings["stall_s"] = time.perf_counter() - started
            self._pending = self._executor.submit(self._finish, job, upload)
        else:
            self._write(job, tree)
            self._finish(job, None)

    def _write(self, job: _SaveJob, tree: dict[str, Any]) -> None:
        """Collective (DCP). Write the shards into the temporary folder; on failure, remove it and raise one line
        (CheckpointException is a BaseException: ``except Exception`` alone would skip the cleanup)."""
        writer = digesting(self.store.dcp_writer(job.tmp, thread_count=self.io_threads))
        job.written = writer.fs
        try:
            dcp.save(tree, storage_writer=writer, process_group=self.coord.io)
        except (Exception, CheckpointException) as exc:
            if self.coord.rank == 0:  # DCP raises on every rank; leave no half-written directory behind
                _delete_quietly(self.store, job.tmp)
            if isinstance(exc, (OSError, CheckpointException)) or self.store.describe_error(exc, self.folder):
                raise CheckpointError(f"{describe_failure(exc, self.folder, job.needed)} (save of step {job.step} "
                                      f"to {job.tmp})",  # DCP's CheckpointException holds every rank's failure
                                      same_on_every_rank=isinstance(exc, CheckpointException)) from exc
            raise

    def _new_job(self, step: int, tree: dict[str, Any], **fields: Any) -> _SaveJob:
        """Collective. The save's attempt folder, named by rank 0, which first refuses (on every rank) when the
        folder has less free space than the checkpoint's tensors take, or its object store does not answer."""
        needed = payload_bytes(tree)
        verdict = None
        if self.coord.rank == 0:
            try:  # an object store that stopped answering: one line within seconds, before any rank writes
                self.store.probe(self.folder)
                no_room = check_room(self.folder, needed)
            except CheckpointError as exc:
                no_room = str(exc)
            verdict = {"error": no_room} if no_room else {"token": secrets.token_hex(4)}
        verdict = self.coord.broadcast(verdict)
        if "error" in verdict:
            raise CheckpointError(f"{verdict['error']} (save of step {step})", same_on_every_rank=True)
        final = self.store.join(self.folder, step_dir_name(step))
        return _SaveJob(step=step, tmp=self.store.attempt_path(self.folder, final, verdict["token"]), needed=needed,
                        **fields)

    def wait(self) -> None:
        """Block until the in-flight async save is published; raise its error. No collective of its own."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Wait for the in-flight save and release the background thread and the staging buffers."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            self._writer = None

    def _ensure_folder_checked(self) -> None:
        if not self._folder_checked:
            check_shared_folder(self.coord, self.folder)  # collective
            self._folder_checked = True

    def _check_agreement(self, step: int, state: dict[str, Any], tree: dict[str, Any]) -> None:
        """Collective. Every rank is saving the same step with equal replicated state (DCP stores one copy)."""
        self.coord.barrier(f"save of step {step}")
        digests = {"step": str(step)}
        for name, obj in state.items():
            if getattr(obj, "replicated", False):
                digest = hashlib.sha256()
                for key, leaf in walk(tree[name]):
                    digest.update(key.encode() + leaf.detach().cpu().numpy().tobytes())
                digests[name] = digest.hexdigest()
        views = self.coord.all_gather(digests)
        odd = {r: sorted(k for k in view if view[k] != views[0].get(k)) for r, view in enumerate(views)}
        odd = {r: keys for r, keys in odd.items() if keys}
        if odd:
            detail = "; ".join(f"rank {r}: {', '.join(keys)}" for r, keys in odd.items())
            raise CheckpointError(
                f"save of step {step}: ranks disagree with rank 0 on state that DCP stores once for all ({detail}; "
                f"rank 0 saves step {step}); the trainer must call save at the same step on every rank and keep "
                "counters, scheduler and metrics identical on all ranks (reduce metrics before storing them)",
                same_on_every_rank=True)

    def _staging_writer(self) -> _StagingWriter:
        if self._writer is None:
            # DCP's pinned staging buffers, kept between saves, where CUDA can pin them; CPU-only builds cannot.
            self._writer = digesting(self.store.dcp_writer(self.folder, thread_count=self.io_threads,
                                                           staging_cls=_StagingWriter,
                                                           cache_staged_state_dict=torch.cuda.is_available()))
        return self._writer

    def _finish(self, job: _SaveJob, upload: Future | None) -> None:
        """Hash, gather, publish. Runs on the training thread (sync) or the background thread (async).

        Collective on the io group: every rank reaches the gather and the broadcast, whatever failed before.
        """
        contribution: dict[str, Any]
        try:
            if upload is not None:
                upload.result()
            job.timings["write_s"] = time.perf_counter() - job.started
            contribution = {"files": self._hash_own_files(job.tmp, job.written)}
            job.timings["hash_s"] = time.perf_counter() - job.started - job.timings["write_s"]
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - reported on every rank below
            contribution = {"error": describe_failure(exc, self.folder, job.needed)}
        contributions = self.coord.gather(contribution, group="io")
        outcome = self._publish(job, contributions) if self.coord.rank == 0 else None
        outcome = self.coord.broadcast(outcome, group="io")
        if outcome is not None:
            raise CheckpointError(outcome, same_on_every_rank=True)
        job.timings["total_s"] = time.perf_counter() - job.started
        self._last_step = job.step

    def _hash_own_files(self, tmp: str, written: DigestingFileSystem | None) -> dict[str, dict[str, Any]]:
        """Sizes and SHA-256 of the shard files this rank wrote (DCP names them __<rank>_<n>.distcp), plus, on
        rank 0, every other file (.metadata). The digests come from the writer (taken as the bytes went out); each
        file's stored size must equal the bytes written. A file the writer did not hash is read back and hashed."""
        def owner(name: str) -> int:
            match = _SHARD_RE.match(name)
            return int(match.group(1)) if match and int(match.group(1)) < self.coord.size else 0

        listing = {i.name: i for i in self.store.list(tmp) if i.kind == "file" and owner(i.name) == self.coord.rank}
        files = written.take(tmp, sorted(listing)) if written is not None else {}
        for name, entry in files.items():
            stored = listing[name].size  # both stores list sizes: no further request per file
            if stored != entry["size"]:
                raise CheckpointError(f"{self.store.join(tmp, name)}: {stored} bytes stored but {entry['size']} "
                                      "written; the storage lost part of the file (disk full, or an interrupted "
                                      "upload): the checkpoint is not published")
        files.update(describe_files(tmp, sorted(set(listing) - set(files)), threads=self.io_threads))
        return files

    def _publish(self, job: _SaveJob, contributions: list[dict[str, Any]]) -> str | None:
        """Rank 0: manifest, COMPLETE, rename, retention. Returns None, or the error every rank will raise."""
        errors = [f"rank {r}: {c['error']}" for r, c in enumerate(contributions) if "error" in c]
        if errors:
            _delete_quietly(self.store, job.tmp)
            full = [c["error"] for c in contributions if c.get("error", "").startswith("no space left")]
            if full:  # one line, as for a sync save
                return f"{full[0]} (save of step {job.step} to {job.tmp})"
            return f"save of step {job.step} to {job.tmp} failed; " + "; ".join(errors)
        try:
            files: dict[str, dict[str, Any]] = {}
            for contribution in contributions:
                files.update(contribution["files"])
            unhashed = sorted(i.name for i in self.store.list(job.tmp) if i.name not in files)
            files.update(describe_files(job.tmp, unhashed, threads=self.io_threads))  # files no rank claimed (a DCP naming change)
            job.timings["total_s"] = time.perf_counter() - job.started
            manifest = build_manifest(
                step=job.step, files=files, world_size=self.coord.size, layout=self.layout,
                config_fingerprint=self.config_fingerprint, code=self.code, meta=job.meta, state_kinds=job.kinds,
                final=job.final, async_save=self.cfg.async_save and not job.final, timings=job.timings)
            payload = json.dumps(manifest, indent=1).encode()
            write_durable(self.store.join(job.tmp, MANIFEST), payload)
            # COMPLETE last, binding the manifest's digest: a damaged manifest is then told from a damaged shard.
            final_dir = self._publish_step(job, f"manifest-sha256 {hashlib.sha256(payload).hexdigest()}\n".encode())
            log.info("saved step %d to %s (%s, %.2fs)", job.step, final_dir,
                     format_bytes(sum(f["size"] for f in files.values())), time.perf_counter() - job.started)
            self._apply_retention(protect=(job.step,))
        except Exception as exc:  # noqa: BLE001 - returned so that every rank raises it
            reason = self.store.describe_error(exc, self.folder) or f"{type(exc).__name__}: {exc}"
            return f"save of step {job.step}: publishing {job.tmp} failed: {reason}"
        return None

    def _publish_step(self, job: _SaveJob, marker: bytes) -> str:
        """Rank 0: make the attempt the step's checkpoint (COMPLETE last; see Store.publish)."""
        final_dir = self.store.join(self.folder, step_dir_name(job.step))
        if self.store.exists(self.store.join(final_dir, "COMPLETE")) or (self.store.atomic_rename
                                                                         and self.store.exists(final_dir)):
            # same step saved before (resume=none, or a fallback past a damaged one): replaced
            log.warning("replacing %s: %s", final_dir, self._describe_existing(final_dir, job.step))
        self.store.publish(job.tmp, final_dir, marker, replace=True)
        self._published.add(job.step)
        return final_dir

    def _describe_existing(self, path: str, step: int) -> str:
        """Rank 0: what the checkpoint directory of ``step``, about to be replaced, holds, and whether this
        Checkpointer published it."""
        try:
            problems = check_structure(path)[1]
        except OSError as exc:
            problems = [f"cannot be read: {exc}"]
        state = f"incomplete or damaged ({problems[0]})" if problems else "a complete checkpoint of the same step"
        who = ("written by this process" if step in self._published else
               "not written by this process (an earlier run, or this job before a restart)")
        return f"{state}, {who}"

    def _apply_retention(self, *, protect: tuple[int, ...]) -> None:
        """Rank 0: delete complete checkpoints outside keep_last/keep_every (never the newest), and leftovers
        (.tmp/.del directories) of jobs that ended before this one started."""
        entries = scan(self.folder)
        keep = steps_to_keep(complete_steps(entries), keep_last=self.cfg.keep_last, keep_every=self.cfg.keep_every,
                             protect=protect)
        for entry in entries:
            if entry.kind == "complete" and entry.step not in keep:
                self.store.retire(entry.path)  # COMPLETE (object store) or the name (local) goes first
            elif entry.kind in ("tmp", "trash") and self.store.mtime(entry.path) < self._started:
                self.store.delete(entry.path, recursive=True)  # left by a job that ended before this one started
            else:
                continue
            log.info("retention: deleted %s", entry.path)
        self.store.sync(self.folder)

    # ------------------------------------------------------------------ load
    def load(self, state: dict[str, Any], resume: str | None = None, *, known: loading.Findings | None = None,
             folder_checked: bool = False) -> dict[str, Any] | None:
        """Resume into ``state`` (the dict given to save). Collective.

        ``resume`` (default: checkpoint.resume): "none" starts fresh; "auto" loads the newest checkpoint that has
        COMPLETE and checks out (sizes of each candidate, SHA-256 of the chosen one split over ranks), skipping and
        reporting the others, or refusing when checkpoint.strict; it starts fresh where no checkpoint has COMPLETE,
        and refuses where every one that has is damaged; a path loads exactly that or raises. Returns the manifest
        loaded, or None when starting fresh. What was skipped or changed is in ``notes`` (and logged). ``known``:
        what checksums this start already verified (loading.foresee, rank 0's), not hashed again. ``folder_checked``
        (alike on every rank): this start already checked on these ranks that the folder is shared (before foresee's
        checksums), not checked again.
        """
        resume = self.cfg.resume if resume is None else resume
        self.wait()
        self.notes = []
        if resume == "none":
            self._note_existing()
            return None
        explicit = None if resume == "auto" else resume
        self._folder_checked = self._folder_checked or folder_checked
        if explicit is None:
            self._ensure_folder_checked()
        chosen = loading.choose(self.coord, self.folder, explicit=explicit, strict=self.cfg.strict,
                                verify_checksums=self.verify_checksums, threads=self.io_threads, notes=self.notes,
                                known=known)
        if chosen is None:
            self._report("no complete checkpoint in %s; starting fresh" % self.folder, level=logging.INFO)
            return None
        path, manifest = chosen
        loading.load_into(self.coord, state, path)
        self._report_changes(path, manifest, state)
        self._last_step, self._last_save_time = manifest["step"], time.monotonic()
        return manifest

    def _report(self, message: str, *, level: int = logging.WARNING) -> None:
        """Keep ``message`` in ``notes`` and log it on rank 0 (a fresh start is news, not a warning)."""
        self.notes.append(message)
        if self.coord.rank == 0:
            log.log(level, message)

    def _note_existing(self) -> None:
        if self.coord.rank == 0:
            steps = complete_steps(scan(self.folder))
            if steps:
                self._report(f"checkpoint.resume=none, but {self.folder} holds checkpoints up to step {steps[-1]}; "
                             "a later resume=auto may pick them up: use a fresh checkpoint.dir for a new run")

    def _report_changes(self, path: str, manifest: dict[str, Any], state: dict[str, Any]) -> None:
        if self.coord.rank == 0:
            log.info("resumed from %s (step %s)", path, manifest["step"])
        if manifest["world_size"] != self.coord.size:
            saved, now = manifest["world_size"], self.coord.size
            extra = (f"ranks {saved}..{now - 1} had no saved RNG stream and reseeded deterministically" if now > saved
                     else f"the RNG streams of ranks {now}..{saved - 1} were not loaded")
            self._report(f"{path} was saved by {saved} ranks and is loaded by {now} (resharded); {extra}")
        if manifest.get("config_fingerprint") != self.config_fingerprint:
            changed = describe_changes(saved_config(manifest), self.config)
            self._report(f"{path} was saved with config fingerprint {manifest.get('config_fingerprint')}, this run "
                         f"has {self.config_fingerprint}: the configuration changed since"
                         + (f" ({changed})" if changed else ""))


def _delete_quietly(store: Any, location: str) -> None:
    """Remove a failed save's attempt; a store that cannot be reached keeps it (retention collects it later)."""
    try:
        store.delete(location, recursive=True)
    except Exception as exc:  # noqa: BLE001 - the save's own error is the one to report
        log.warning("could not remove %s after a failed save: %s", location, exc)


def _materialize(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Call state_dict() on the Stateful entries; refuse anything but nested dicts of tensors."""
    tree: dict[str, Any] = {}
    kinds: dict[str, str] = {}
    for name, obj in state.items():
        tree[name] = obj.state_dict() if isinstance(obj, Stateful) else obj
        kinds[name] = type(obj).__name__
        for key, leaf in walk({name: tree[name]}):
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(f"checkpoint state entry {key!r} is a {type(leaf).__name__}; only tensors are saved "
                                "(use the helpers of meshrun.ckpt.state, which store other values as JSON blobs)")
    return tree, kinds
