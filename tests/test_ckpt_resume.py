"""Choosing what to resume, surviving a kill mid-save, retention, async durability, save decisions. One process
(the collectives are no-ops); test_ckpt_dist.py runs the same paths over ranks."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_ckpt_cli import craft_metadata
from test_ckpt_support import Job, assert_same, checkpointer
from torch.distributed.checkpoint import CheckpointException

from meshrun.ckpt import checkpointer as checkpointer_module
from meshrun.ckpt.errors import CheckpointError
from meshrun.ckpt.folder import COMPLETE, MANIFEST, step_dir_name
from meshrun.ckpt.manifest import build_manifest, describe_files
from meshrun.ckpt.preemption import install_sigterm_handler
from meshrun.ckpt.state import CountersState
from meshrun.env import ProcessPlacement

ENV = ProcessPlacement.detect({})


@pytest.fixture
def history(tmp_path):
    """A folder with complete checkpoints at steps 1 and 2, and the state each one holds."""
    job, snapshots = Job(ENV), {}
    ckpt = checkpointer(tmp_path, ENV)
    for step in (1, 2):
        job.train(1, data_seed=step)
        ckpt.save(step, job.state)
        snapshots[step] = job.snapshot()
    return tmp_path, snapshots


def _resume(folder: Path, resume: str = "auto", **overrides) -> tuple[Job, dict | None, list[str]]:
    job = Job(ENV, seed=42)
    ckpt = checkpointer(folder, ENV, **overrides)
    manifest = ckpt.load(job.state, resume=resume)
    return job, manifest, ckpt.notes


def _flip_byte(path: Path, offset: int = 200) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_newest_complete_is_resumed_and_unfinished_ones_are_skipped(history):
    folder, snapshots = history
    shutil.copytree(folder / step_dir_name(2), folder / step_dir_name(3))
    (folder / step_dir_name(3) / COMPLETE).unlink()
    shutil.copytree(folder / step_dir_name(2), folder / ".step_0000004.tmp-dead")
    job, manifest, notes = _resume(folder)
    assert manifest["step"] == 2
    assert_same(job.snapshot(), snapshots[2])
    assert any("step_0000003: it has no COMPLETE marker" in n for n in notes)
    assert any(".step_0000004.tmp-dead: it is an unfinished save" in n for n in notes)


def test_corrupted_shard_is_named_and_the_previous_one_used(history):
    folder, snapshots = history
    _flip_byte(folder / step_dir_name(2) / "__0_0.distcp")
    job, manifest, notes = _resume(folder)
    assert manifest["step"] == 1
    assert_same(job.snapshot(), snapshots[1])
    assert any("step_0000002/__0_0.distcp: sha256" in n and "damaged" in n for n in notes), notes


def test_truncated_shard_and_manifest_fall_back(history):
    folder, snapshots = history
    shard = folder / step_dir_name(2) / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    _, manifest, notes = _resume(folder)
    assert manifest["step"] == 1 and any("__0_0.distcp: size" in n for n in notes)
    assert any("falling back to the previous complete checkpoint" in n for n in notes), notes
    text = (folder / step_dir_name(1) / MANIFEST).read_text()
    (folder / step_dir_name(1) / MANIFEST).write_text(text[:100])
    records, log = _Records(), logging.getLogger("meshrun.ckpt")
    log.addHandler(records)
    try:  # nothing valid left: refused, not a new run among the earlier run's checkpoints
        with pytest.raises(CheckpointError, match=r"^checkpoint\.resume=auto: the complete checkpoints in .* are all "
                           r"damaged \(step_0000002, step_0000001; each named above\): .*--fresh") as refused:
            _resume(folder)
    finally:
        log.removeHandler(records)
    assert refused.value.same_on_every_rank
    damaged = [m for m in records.messages if m.startswith("checkpoint ")]
    assert len(damaged) == 2 and "step_0000001/manifest.json: not valid JSON" in damaged[1], damaged
    assert damaged[0].endswith("falling back to the previous complete checkpoint"), damaged[0]
    assert damaged[1].endswith("no earlier complete checkpoint is left"), "no fallback promised after the oldest"


def test_the_oldest_checkpoint_damaged_in_its_data_promises_no_fallback(history):
    """A shard of the only complete checkpoint fails its SHA-256 (found after the cheap checks): the line says none
    is left, and the resume is refused; a folder with no complete checkpoint at all starts fresh."""
    folder, _ = history
    shutil.rmtree(folder / step_dir_name(2))
    _flip_byte(folder / step_dir_name(1) / "__0_0.distcp")
    job = Job(ENV, seed=42)
    ckpt = checkpointer(folder, ENV)
    with pytest.raises(CheckpointError, match=r"are all damaged \(step_0000001;"):
        ckpt.load(job.state)
    assert len(ckpt.notes) == 1 and "__0_0.distcp: sha256" in ckpt.notes[0], ckpt.notes
    assert ckpt.notes[0].endswith("; no earlier complete checkpoint is left"), ckpt.notes[0]
    (folder / step_dir_name(1) / COMPLETE).unlink()
    _, manifest, notes = _resume(folder)
    assert manifest is None and any("no complete checkpoint" in n for n in notes), notes


def test_strict_refuses_to_fall_back(history):
    folder, _ = history
    _flip_byte(folder / step_dir_name(2) / "__0_0.distcp")
    with pytest.raises(CheckpointError, match=r"step_0000002/__0_0\.distcp.*checkpoint\.strict=true"):
        _resume(folder, strict=True)


def test_explicit_path_loads_exactly_that_or_fails(history):
    folder, snapshots = history
    job, manifest, _ = _resume(folder, resume=str(folder / step_dir_name(1)))
    assert manifest["step"] == 1
    assert_same(job.snapshot(), snapshots[1])
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        _resume(folder, resume=str(folder / "step_0000009"))
    _flip_byte(folder / step_dir_name(2) / ".metadata", offset=50)
    with pytest.raises(CheckpointError, match=r"step_0000002/\.metadata.*names this checkpoint"):
        _resume(folder, resume=str(folder / step_dir_name(2)))


def test_resume_none_starts_fresh_and_says_what_it_ignores(history):
    folder, _ = history
    job, manifest, notes = _resume(folder, resume="none")
    assert manifest is None and job.counters.step == 0
    assert any("holds checkpoints up to step 2" in n for n in notes)


def test_pickled_entry_is_refused(tmp_path):
    """A crafted checkpoint whose counter is a pickled object (DCP would unpickle it) is refused before DCP runs."""
    folder = tmp_path / step_dir_name(1)
    dcp.save({"trainer": {"step": 5, "epoch": torch.tensor(0), "tokens_seen": torch.tensor(0),
                          "samples_in_epoch": torch.tensor(0)}}, checkpoint_id=str(folder))
    names = sorted(p.name for p in folder.iterdir())
    manifest = build_manifest(step=1, files=describe_files(folder, names), world_size=1, layout={},
                              config_fingerprint="fp-test", code={}, meta={}, state_kinds={}, final=False,
                              async_save=False, timings={})
    (folder / MANIFEST).write_text(json.dumps(manifest))
    (folder / COMPLETE).write_text("")
    with pytest.raises(CheckpointError, match="'trainer.step' is stored as a pickled object"):
        checkpointer(tmp_path, ENV).load({"trainer": CountersState()})


def test_crafted_metadata_is_refused_on_resume(history, tmp_path):
    """A .metadata that would run code when unpickled (manifest recomputed to match) is refused, naming the file."""
    folder, _ = history
    marker = tmp_path / "pwned"
    craft_metadata(folder / step_dir_name(2), marker)
    for resume in ("auto", str(folder / step_dir_name(2))):
        with pytest.raises(CheckpointError, match=r"step_0000002/\.metadata: refers to the global posix\.system"):
            _resume(folder, resume=resume)
    assert not marker.exists()


_KILLED_SAVE = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    from test_ckpt_support import Job, checkpointer
    from meshrun.ckpt import checkpointer as module
    from meshrun.env import ProcessPlacement

    env = ProcessPlacement.detect({{}})
    job, ckpt = Job(env), checkpointer({folder!r}, env)
    job.train(1, data_seed=1)
    ckpt.save(1, job.state)
    job.train(1, data_seed=2)
    write = module.write_durable
    def die_before_manifest(path, data):
        if os.path.basename(path) == "manifest.json":
            os.kill(os.getpid(), signal.SIGKILL)  # shards of step 2 are on disk, manifest and COMPLETE are not
        write(path, data)
    module.write_durable = die_before_manifest
    ckpt.save(2, job.state)
""")


def test_kill_during_save_leaves_the_previous_checkpoint(tmp_path):
    script = _KILLED_SAVE.format(tests=str(Path(__file__).parent), folder=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    leftovers = list(tmp_path.glob(".step_0000002.tmp-*"))
    assert len(leftovers) == 1 and list(leftovers[0].glob("*.distcp"))
    job, manifest, notes = _resume(tmp_path)
    assert manifest["step"] == 1 and any("unfinished save" in n for n in notes)
    # the next job's first save clears what the killed one left behind
    checkpointer(tmp_path, ENV).save(2, job.state)
    assert not list(tmp_path.glob(".step_*")) and (tmp_path / step_dir_name(2) / COMPLETE).is_file()


def test_retention_keeps_last_and_every_nth(tmp_path):
    job = Job(ENV)
    ckpt = checkpointer(tmp_path, ENV, keep_last=2, keep_every=4)
    for step in range(1, 10):
        ckpt.save(step, job.state)
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_dir_name(s) for s in (4, 8, 9)]


def test_same_step_is_saved_once_and_an_old_runs_dir_is_replaced(tmp_path):
    job = Job(ENV)
    ckpt = checkpointer(tmp_path, ENV)
    ckpt.save(1, job.state)
    first = json.loads((tmp_path / step_dir_name(1) / MANIFEST).read_text())["created_unix"]
    ckpt.save(1, job.state, final=True)  # e.g. the final save right after an interval save
    assert json.loads((tmp_path / step_dir_name(1) / MANIFEST).read_text())["created_unix"] == first
    checkpointer(tmp_path, ENV).save(1, job.state)  # a new run (resume=none) reaching step 1 again
    assert json.loads((tmp_path / step_dir_name(1) / MANIFEST).read_text())["created_unix"] > first
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_dir_name(1)]


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_replacing_a_damaged_step_says_what_it_is_and_who_wrote_it(tmp_path):
    """A damaged step_2 is passed over on resume and rewritten when training reaches step 2 again; the warning
    says it was damaged and whether this process or an earlier one wrote it."""
    job = Job(ENV)
    ckpt = checkpointer(tmp_path, ENV)
    for step in (1, 2):
        ckpt.save(step, job.state)
    shard = tmp_path / step_dir_name(2) / "__0_0.distcp"
    records, log = _Records(), logging.getLogger("meshrun.ckpt")
    log.addHandler(records)  # on the logger itself: whatever an in-process trainer did to propagation before
    try:
        for later in (False, True):  # the Checkpointer that wrote step_2, then a later one (a restarted job)
            writer = checkpointer(tmp_path, ENV) if later else ckpt
            shard.write_bytes(shard.read_bytes()[:-1])
            assert writer.load(job.state)["step"] == 1
            records.messages.clear()
            writer.save(2, job.state)
            replaced = [m for m in records.messages if m.startswith("replacing")]
            who = "not written by this process" if later else ", written by this process"
            assert len(replaced) == 1 and "incomplete or damaged" in replaced[0] and "__0_0.distcp" in replaced[0]
            assert who in replaced[0], replaced[0]
    finally:
        log.removeHandler(records)


def test_async_save_publishes_only_after_every_file_is_durable(tmp_path, monkeypatch):
    entered, release, synced, real_fsync = threading.Event(), threading.Event(), [], os.fsync
    real_describe = checkpointer_module.describe_files

    def record_fsync(fd):
        synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def held_describe(*args, **kwargs):  # the background thread stops here: shards written, nothing published
        entered.set()
        release.wait(timeout=60)
        return real_describe(*args, **kwargs)

    monkeypatch.setattr(os, "fsync", record_fsync)
    monkeypatch.setattr(checkpointer_module, "describe_files", held_describe)
    job = Job(ENV)
    ckpt = checkpointer(tmp_path, ENV, async_save=True)
    ckpt.save(1, job.state)
    assert entered.wait(timeout=60)  # save() returned while the write is still held
    assert list(tmp_path.glob(".step_0000001.tmp-*/__0_0.distcp"))
    assert not (tmp_path / step_dir_name(1)).exists() and not list(tmp_path.rglob(COMPLETE))
    job.train(1, data_seed=3)  # training goes on while the write is in flight; the staged copy is saved
    release.set()
    ckpt.close()
    assert (tmp_path / step_dir_name(1) / COMPLETE).is_file()
    order = [name for name in synced if name in ("__0_0.distcp", ".metadata.tmp", MANIFEST, COMPLETE)]
    assert order.index(MANIFEST) > max(order.index("__0_0.distcp"), order.index(".metadata.tmp"))
    assert order.index(COMPLETE) > order.index(MANIFEST)
    timings = json.loads((tmp_path / step_dir_name(1) / MANIFEST).read_text())["timings"]
    assert timings["stall_s"] < timings["total_s"]
    fresh = Job(ENV, seed=3)
    checkpointer(tmp_path, ENV).load(fresh.state)
    assert_same(fresh.snapshot(), Job(ENV).snapshot())


def test_should_save_by_steps_and_on_sigterm(tmp_path):
    ckpt = checkpointer(tmp_path, ENV, interval_steps=3)
    assert [s for s in range(1, 8) if ckpt.should_save(s)] == [3, 6]
    flag = install_sigterm_handler()
    try:
        ckpt.preemption = flag
        assert not ckpt.should_save(4) and not ckpt.stop_requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.is_set() and flag.signal_name == "SIGTERM"
        assert ckpt.should_save(4) and ckpt.stop_requested
        quiet = checkpointer(tmp_path, ENV, interval_steps=3, final=False)
        quiet.preemption = flag
        assert not quiet.should_save(4) and quiet.stop_requested, "final=false: stop without saving"
    finally:
        flag.restore()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


_ZIP_WRITER_FULL = RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos 704 vs 598")


def _no_space_left(message: str, folder: Path, free: str) -> int:
    """Bytes needed, from a no-space message whose first line names ``folder`` and ``free``."""
    match = re.match(rf"no space left on {re.escape(str(folder))}: ([\d,]+) bytes needed, {free} free", message)
    assert match, message
    assert "inline_container" not in message and "Traceback" not in message
    return int(match.group(1).replace(",", ""))


@pytest.mark.parametrize("failure", [
    CheckpointException("save failed", {0: (OSError(errno.ENOSPC, "No space left on device"), None)}),
    OSError(errno.ENOSPC, "No space left on device"),
    CheckpointException("save failed", {0: (_ZIP_WRITER_FULL, None)}),  # no errno: told by the free space left
], ids=["dcp-enospc", "enospc", "zip-writer"])
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_disk_full_during_save_removes_the_tmp_folder_and_says_so(tmp_path, monkeypatch, failure, async_save):
    job = Job(ENV)
    ckpt = checkpointer(tmp_path, ENV, async_save=async_save)
    ckpt.save(1, job.state)
    full, real_usage = [], shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real_usage(path)._replace(free=500 if full else 1 << 50))

    def write_then_fail(folder):  # a partial shard, then the disk is full
        Path(folder).mkdir(parents=True)
        (Path(folder) / "__0_0.distcp").write_bytes(b"partial")
        full.append(True)

    def failing_save(state_dict, *, storage_writer, **kwargs):
        write_then_fail(storage_writer.path)
        raise failure

    def failing_async_save(state_dict, *, checkpoint_id, **kwargs):
        write_then_fail(checkpoint_id)
        upload = Future()
        upload.set_exception(failure)
        return upload

    monkeypatch.setattr(checkpointer_module.dcp, "save", failing_save)
    monkeypatch.setattr(checkpointer_module.dcp, "async_save", failing_async_save)
    with pytest.raises(CheckpointError) as caught:
        ckpt.save(2, job.state)
        ckpt.wait()  # async: the background write's error
    needed = _no_space_left(str(caught.value), tmp_path, "500 bytes")
    assert needed >= sum(p.numel() * p.element_size() for p in job.model.parameters())
    assert not list(tmp_path.glob(".step_*")), "the temporary folder is removed"
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_dir_name(1)]


def test_save_refuses_early_when_the_folder_has_too_little_space(tmp_path, monkeypatch):
    job = Job(ENV)
    ckpt = checkpointer(tmp_path, ENV)
    real_usage, writes = shutil.disk_usage, []
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real_usage(path)._replace(free=1000))
    monkeypatch.setattr(checkpointer_module.dcp, "save", lambda *args, **kwargs: writes.append(args))
    with pytest.raises(CheckpointError) as caught:
        ckpt.save(1, job.state)
    assert _no_space_left(str(caught.value), tmp_path, "1,000 bytes") > 1000
    assert writes == [] and not list(tmp_path.iterdir())
