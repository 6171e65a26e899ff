"""The model a resume builds and the checkpoint it loads are decided alike: when the newest checkpoint is damaged
(found only by its checksums) and the one the load falls back to has the other tie state (model.tie_embeddings),
the trainer builds the model of the checkpoint it loads, and its files are hashed once.

* peek walks the checkpoints as choose does (the same quiet helper), and says nothing;
* foresee finds quietly what choose will pick, and choose takes its findings instead of hashing the files again,
  with the same notes;
* through the trainer: tied then untied, and untied then tied, the newest damaged: the run resumes the older one with
  its tie state and trains on (one process, and two ranks).
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from pathlib import Path
from typing import Iterator

import pytest
from dist_utils import run_distributed
from test_ckpt_resume import _flip_byte, history  # noqa: F401 - the fixture
from test_ckpt_support import Job, checkpointer
from test_resume import _restore_logging, _worker, job
from test_tied_resume import COMMON, ONE

from meshrun.ckpt import loading
from meshrun.ckpt.collectives import Coordinator
from meshrun.ckpt.folder import COMPLETE, step_dir_name
from meshrun.env import ProcessPlacement
from meshrun.train.trainer import Trainer

ENV = ProcessPlacement.detect({})
UNTIED = "--model.tie_embeddings=false"


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def ckpt_log():
    records, log = _Records(), logging.getLogger("meshrun.ckpt")
    log.addHandler(records)
    yield records
    log.removeHandler(records)


@pytest.fixture
def hashed(monkeypatch):
    """The checkpoint directories whose files were hashed, one entry per rank's pass."""
    passes: list[str] = []
    real = loading.check_checksums

    def counting(folder, manifest, names, **kwargs):
        passes.append(Path(folder).name)
        return real(folder, manifest, names, **kwargs)

    monkeypatch.setattr(loading, "check_checksums", counting)
    return passes


# ---- choosing: one walk, one hashing ---------------------------------------------------------------------------

def test_peek_walks_the_checkpoints_as_choose_does_and_says_nothing(history, ckpt_log):  # noqa: F811
    """A truncated shard (the cheap checks find it) and a directory without COMPLETE are passed over by both."""
    folder, _ = history
    shutil.copytree(folder / step_dir_name(2), folder / step_dir_name(3))
    shard = folder / step_dir_name(3) / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    shutil.copytree(folder / step_dir_name(2), folder / step_dir_name(4))
    (folder / step_dir_name(4) / COMPLETE).unlink()
    assert [m["step"] for m in loading.peek(str(folder), None)] == [2, 1]
    assert [m["step"] for m in loading.peek(str(folder), str(folder / step_dir_name(1)))] == [1]
    assert list(loading.peek(str(folder), str(folder / step_dir_name(3)))) == []
    assert list(loading.peek(str(folder / "absent"), None)) == []
    assert ckpt_log.messages == []
    notes: list[str] = []
    path, manifest = loading.choose(Coordinator(timeout_s=60), str(folder), explicit=None, strict=False,
                                    verify_checksums=True, threads=1, notes=notes)
    assert manifest["step"] == 2 and path.endswith(step_dir_name(2))
    assert [n.split(": ")[0] for n in notes] == [f"skipped {folder / step_dir_name(4)}",
                                                 f"checkpoint {folder / step_dir_name(3)} is damaged"], notes
    assert ckpt_log.messages == notes


def _choose(folder: Path, known: loading.Findings | None = None) -> tuple[str, list[str]]:
    notes: list[str] = []
    path, _ = loading.choose(Coordinator(timeout_s=60), str(folder), explicit=None, strict=False,
                             verify_checksums=True, threads=1, notes=notes, known=known)
    return path, notes


def test_choose_takes_what_foresee_found_instead_of_hashing_again(history, ckpt_log, hashed):  # noqa: F811
    folder, _ = history
    _flip_byte(folder / step_dir_name(2) / "__0_0.distcp")
    without = _choose(folder)
    assert hashed == [step_dir_name(2), step_dir_name(1)]
    hashed.clear()
    ckpt_log.messages.clear()
    (path, manifest), known = loading.foresee(Coordinator(timeout_s=60), str(folder), explicit=None, strict=False,
                                              threads=1)
    assert manifest["step"] == 1 and path == without[0]
    assert ckpt_log.messages == [], "foresee is quiet: choose says what it finds"
    assert _choose(folder, known) == without
    assert hashed == [step_dir_name(2), step_dir_name(1)], "each checkpoint hashed once, by foresee"
    assert ckpt_log.messages == without[1]
    _choose(folder)  # only a choose given the findings takes them: nothing is kept between calls
    assert hashed == [step_dir_name(2), step_dir_name(1)] * 2


def test_a_checkpoint_changed_after_foresee_is_hashed_again(history, hashed):  # noqa: F811
    """Findings are taken for the checkpoint foresee hashed, not for one saved again at that step."""
    folder, _ = history
    _, known = loading.foresee(Coordinator(timeout_s=60), str(folder), explicit=None, strict=False, threads=1)
    assert hashed == [step_dir_name(2)]
    job = Job(ENV)
    job.train(1, data_seed=7)
    shutil.rmtree(folder / step_dir_name(2))
    checkpointer(folder, ENV).save(2, job.state)
    assert _choose(folder, known)[0].endswith(step_dir_name(2))
    assert hashed == [step_dir_name(2)] * 2


def test_foresee_finds_nothing_where_choose_refuses(history):  # noqa: F811
    folder, _ = history
    for step in (1, 2):
        _flip_byte(folder / step_dir_name(step) / "__0_0.distcp")
    coord = Coordinator(timeout_s=60)
    assert loading.foresee(coord, str(folder), explicit=None, strict=False, threads=1)[0] is None
    assert loading.foresee(coord, str(folder), explicit=str(folder / "step_0000009"), strict=False,
                           threads=1)[0] is None


# ---- through the trainer ---------------------------------------------------------------------------------------

def _checkpoints(run: Path) -> Path:
    return run / "checkpoints"


def _newest_damaged_over(run: Path, older: str, newer: str) -> None:
    """``run``'s checkpoints: step 4 trained with the tie option ``older``, step 8 (trained in another run) with
    ``newer``, a shard of step 8 damaged with its size kept: only its checksum tells."""
    other = run.with_name(run.name + "-newer")
    _trained(run, 4, older)
    _trained(other, 8, newer)
    shutil.copytree(_checkpoints(other) / step_dir_name(8), _checkpoints(run) / step_dir_name(8))
    assert _tied_as_saved(run, 4) is (older != UNTIED) and _tied_as_saved(run, 8) is (newer != UNTIED)
    _flip_byte(_checkpoints(run) / step_dir_name(8) / "__0_0.distcp")


@contextlib.contextmanager
def _trainer(run: Path, steps: int, *options: str) -> Iterator[Trainer]:
    """A single-process trainer of ``run``, closed after, with the logging it set up undone."""
    meshrun_log = logging.getLogger("meshrun")
    saved_logging = meshrun_log, list(meshrun_log.handlers), meshrun_log.propagate, meshrun_log.level
    trainer = Trainer(job(run, steps=steps, extra=(*COMMON, *ONE, *options)))
    try:
        yield trainer
    finally:
        trainer.close()
        _restore_logging(*saved_logging)


def _trained(run: Path, steps: int, option: str) -> None:
    with _trainer(run, steps, *([option] if option else [])) as trainer:
        trainer.fit()


def _tied_as_saved(run: Path, step: int) -> bool:
    manifest = json.loads((_checkpoints(run) / step_dir_name(step) / "manifest.json").read_text())
    return manifest["meta"]["config"]["model"]["tie_embeddings"]


@pytest.mark.parametrize("older, newer", [(UNTIED, ""), ("", UNTIED)], ids=["untied-then-tied", "tied-then-untied"])
def test_a_damaged_newest_checkpoint_resumes_the_older_one_with_its_tie_state(tmp_path, older, newer, hashed):
    """untied-then-tied: the model built tied refused the untied step 4; tied-then-untied: it trained the tied step 4
    untied. Either way the model is the older checkpoint's now, and each checkpoint is hashed once."""
    run = tmp_path / "run"
    _newest_damaged_over(run, older, newer)
    hashed.clear()
    tied = older != UNTIED
    with _trainer(run, 12) as trainer:
        assert trainer.resumed["step"] == 4
        model = trainer.engine.model_parts[0]
        assert trainer.job.model.tie_embeddings is tied
        assert (model.output.weight is model.tok_embeddings.weight) is tied
        assert any(f"{step_dir_name(8)}/__0_0.distcp: sha256" in n and "falling back" in n
                   for n in trainer.ckpt.notes), trainer.ckpt.notes
        assert hashed == [step_dir_name(8), step_dir_name(4)]
        result = trainer.fit()
    assert result.step == 12 and len(result.losses) == 8
    assert _tied_as_saved(run, 12) is tied
    log = (run / "logs" / "rank_00000.log").read_text()
    assert ("the checkpoint to resume (step 4) has untied embeddings" in log) is not tied, log


@pytest.mark.slow
def test_two_ranks_resume_the_older_checkpoint_with_its_tie_state(tmp_path):
    """The checksums split over the ranks decide the model too: untied step 4 below a damaged tied step 8."""
    run = tmp_path / "run"
    _newest_damaged_over(run, UNTIED, "")
    ddp = ("--parallel.dp_replicate=2", "--parallel.dp_shard=1", "--train.micro_batch=4")
    losses = run_distributed(_worker, 2, run, 12, (*COMMON, *ddp), timeout=180)
    assert len(losses[0][0]) == 8
    assert _tied_as_saved(run, 12) is False
    log = (run / "logs" / "rank_00000.log").read_text()
    assert "the checkpoint to resume (step 4) has untied embeddings" in log, log
    assert log.count("falling back to the previous complete checkpoint") == 1, log
