"""A log step's records in one process are written after the next step is queued (train/log_step.py), so the GPU
does not run dry while the host writes them. The records are those the log step would have written at once:
compared field by field with a run that writes them at once (CPU); a step that fails right after a log step still
leaves that log step's record; the runs that must write at once (the last step, an evaluation, a checkpoint by
steps, train.nonfinite=stop) do. On a GPU, taking the snapshot makes no host sync. Each record's tokens/s and step
time cover exactly its own steps, though its record is written a step late (on a stand-in clock; and on a GPU).
"""

from __future__ import annotations

import json
import statistics
from types import SimpleNamespace

import pytest
import torch

from meshrun.train import log_step
from meshrun.train.log_step import IntervalClock, PendingValues
from meshrun.train.trainer import Trainer

from test_resume import job

SMALL = ("--data.max_bytes=200000", "--train.micro_batch=4", "--checkpoint.final=false",
         "--health.check_versions=false", "--train.log_every=2", "--checkpoint.interval_steps=0")
TIMING = {"time", "tokens_per_s", "tokens_per_s_per_device", "mfu", "step_time_s", "peak_mem_gib"}


def _train_records(run_dir) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records if r["kind"] == "train"]


def _run(run_dir, *, defer: bool, steps: int = 7, extra=(), fail_at: int | None = None):
    """Train; record when each log step's record was written (the trainer's step then). ``fail_at``: the data
    loader raises when the trainer asks for that step's batches."""
    trainer = Trainer(job(run_dir, steps=steps, extra=(*SMALL, *extra)))
    written, deferred = [], []
    write_log, defers_log = trainer.write_log, trainer.defers_log
    trainer.write_log = lambda snapshot, result: (written.append((snapshot.step, trainer.step)),
                                                  write_log(snapshot, result))
    trainer.defers_log = lambda: (deferred.append(trainer.step), defers_log() and defer)[1]
    next_step = trainer.data.next_step

    def batches():
        if trainer.step + 1 == fail_at:
            raise RuntimeError("the data loader failed")
        return next_step()

    trainer.data.next_step = batches
    try:
        trainer.fit()
    except RuntimeError as error:
        assert "data loader failed" in str(error)
    finally:
        trainer.close()
    return _train_records(run_dir), written


def test_records_written_a_step_late_equal_those_written_at_once(tmp_path):
    at_once, written_at_once = _run(tmp_path / "at_once", defer=False)
    late, written_late = _run(tmp_path / "late", defer=True)
    assert written_at_once == [(2, 2), (4, 4), (6, 6), (7, 7)]
    assert written_late == [(2, 3), (4, 5), (6, 7), (7, 7)], "after the next step; the last step at once"
    assert [r["step"] for r in late] == [2, 4, 6, 7]
    assert late == at_once  # loss, learning rate, tokens, epoch, gradient norm: all but the clock


def test_a_step_that_fails_after_a_log_step_leaves_its_record(tmp_path):
    records, written = _run(tmp_path, defer=True, fail_at=5)
    assert written == [(2, 3), (4, 4)], "step 4's record, written as the next step failed"
    assert [r["step"] for r in records] == [2, 4]


@pytest.mark.parametrize("extra,at_once", [
    (("--train.eval_every=4",), [4]),  # the evaluation reads the weights of step 4
    (("--checkpoint.interval_steps=4",), [4]),
    (("--train.nonfinite=stop",), [2, 4, 6]),  # it stops at the log step itself
])
def test_steps_that_must_write_at_once_do(tmp_path, extra, at_once):
    _, written = _run(tmp_path, defer=True, extra=extra)
    assert [step for step, when in written if step == when and step != 7] == at_once, written


def _clocked_run(run_dir, monkeypatch, *, steps: int, extra=()) -> tuple[list[dict], int]:
    """Train in one process on a stand-in clock that moves 1 s in each training step and 100 s in each evaluation
    and checkpoint save, and nowhere else; returns the train records and the tokens of one step."""
    now = [0.0]
    monkeypatch.setattr(log_step, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    trainer = Trainer(job(run_dir, steps=steps, extra=(*SMALL, *extra)))

    def taking(seconds, work):
        def timed(*args, **kwargs):
            result = work(*args, **kwargs)
            now[0] += seconds
            return result
        return timed

    trainer.train_step = taking(1.0, trainer.train_step)
    trainer.evaluate = taking(100.0, trainer.evaluate)
    trainer.save_checkpoint = taking(100.0, trainer.save_checkpoint)
    try:
        trainer.fit()
    finally:
        trainer.close()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "train"], trainer.batch.tokens_per_step


@pytest.mark.parametrize("extra", [
    ("--train.log_every=1",),
    ("--train.log_every=2",),
    # evaluations and saves inside intervals (steps 3, 9, 15) and after log steps (6, 12, 18; 10, 20)
    ("--train.log_every=2", "--train.eval_every=3", "--train.eval_samples=8", "--checkpoint.interval_steps=5"),
])
def test_each_record_times_exactly_its_own_steps(tmp_path, monkeypatch, extra):
    """A record written a step late (after the next step ran) still times its own steps, not the next one, and the
    record after it (the last step's, an evaluation's) all of its own; evaluations and saves are left out. The old
    reading of the clock when the record was written gave 1.5 s, 1.0 s, ..., 0.5 s a step here (log_every=2)."""
    records, tokens_per_step = _clocked_run(tmp_path, monkeypatch, steps=20, extra=extra)
    assert [r["step_time_s"] for r in records] == pytest.approx([1.0] * len(records))
    assert [r["tokens_per_s"] for r in records] == pytest.approx([tokens_per_step] * len(records))
    steps = [r["step"] - before["step"] for before, r in zip([{"step": 0}, *records], records)]
    assert sum(steps) == 20 and sum(r["step_time_s"] * n for r, n in zip(records, steps)) == pytest.approx(20.0)
    assert sum(r["tokens_per_s"] * r["step_time_s"] * n for r, n in zip(records, steps)) == 20 * tokens_per_step


def test_interval_clock_leaves_pauses_out_and_tiles_the_rest(monkeypatch):
    """An interval is its stretches of training up to where it was taken, not to where it is read."""
    now = [0.0]
    monkeypatch.setattr(log_step, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    clock = IntervalClock(torch.device("cpu"))
    now[0] = 3.0
    clock.pause()
    now[0] = 50.0  # an evaluation of 47 s
    clock.resume()
    now[0] = 52.0
    first = clock.take()
    now[0] = 58.0
    second = clock.take()
    now[0] = 100.0  # both read later
    assert first() == pytest.approx(5.0) and second() == pytest.approx(6.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("log_every", [1, 2])
def test_on_a_gpu_each_record_times_its_own_steps(tmp_path, log_every):
    """The real clock (CUDA events behind each log step): no record's step time is far off the run's median, where
    the last one's read up to 800x short with train.log_every=1 before."""
    trainer = Trainer(job(tmp_path, steps=40, extra=(*SMALL, f"--train.log_every={log_every}")))
    try:
        trainer.fit()
    finally:
        trainer.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in records if r["kind"] == "train"][2:]  # after the warm-up (compilation)
    median = statistics.median(times)
    assert all(median / 3 < t < 3 * median for t in times), times


def test_pending_values_read_what_was_queued_before_them():
    value = torch.tensor(2.0)
    pending = PendingValues([value, 3, float("nan")], torch.device("cpu"))
    value.add_(1)  # a later step changes the tensor: the snapshot keeps the log step's value
    assert pending.ready() and pending.read()[:2] == [2.0, 3.0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_taking_a_log_snapshot_makes_no_host_sync(tmp_path):
    trainer = Trainer(job(tmp_path, steps=10, extra=SMALL))
    try:
        from meshrun.train.metrics import SumMetrics

        sums = SumMetrics(("loss_sum", "tokens"), trainer.device)
        for _ in range(3):
            loss_sum, tokens, grad_norm = trainer.train_step()
            sums.add(loss_sum=loss_sum, tokens=tokens)
        torch.cuda.synchronize()
        trainer.clock = IntervalClock(trainer.device)  # the loop's; its timing events make no sync either
        torch.cuda.set_sync_debug_mode("error")
        try:
            snapshot = trainer.take_log(sums, 3, grad_norm)
            trainer.take_log(sums, 3, None)  # without clipping or the guard: no gradient norm
        finally:
            torch.cuda.set_sync_debug_mode("default")
        totals, norm, bad, _ = snapshot.read()
        assert totals["tokens"] == 3 * trainer.batch.tokens_per_step and norm is not None and norm > 0 and bad == 0
    finally:
        trainer.close()
