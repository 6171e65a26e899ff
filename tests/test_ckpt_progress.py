"""Trainer progress and the data position as Stateful checkpoint entries: restored in place, resharded, and read
from checkpoints that kept the data position under ``trainer``."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from test_ckpt_support import checkpointer

from meshrun.ckpt.folder import step_dir_name
from meshrun.ckpt.state import CountersState, TrainProgress
from meshrun.data.loader import StepBatches

CPU = torch.device("cpu")
GLOBAL_BATCH = 8


class Numbers(torch.utils.data.Dataset):
    """Sample i is (i, i): which samples a rank got can be read off the batch."""

    def __len__(self) -> int:
        return 50

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor(index), torch.tensor(index)


def batches(dp_rank: int = 0, dp_size: int = 1) -> StepBatches:
    micro = 2
    return StepBatches(Numbers(), dp_rank=dp_rank, dp_size=dp_size, seed=5, micro_batch=micro,
                       grad_accum=GLOBAL_BATCH // (micro * dp_size), device=CPU)


def samples(data: StepBatches) -> list[int]:
    return [int(i) for x, _ in data.next_step() for i in x]


def test_progress_and_position_restore_in_place_at_another_world_size(tmp_path):
    """Saved by one data-parallel rank at step 7 (past an epoch boundary: 6 steps per epoch), loaded into two:
    the objects given to load hold the saved values, and the two ranks' next step is the reference's next step."""
    saved_data, progress = batches(), TrainProgress()
    for _ in range(7):
        samples(saved_data)
        progress.step += 1
        progress.tokens_seen += 100
    ckpt = checkpointer(tmp_path)
    ckpt.save(7, {"trainer": progress, "data": saved_data})
    reference = samples(saved_data)

    ranks = [batches(r, 2) for r in range(2)]
    for data in ranks:
        restored = TrainProgress()
        state = {"trainer": restored, "data": data}
        ckpt.load(state)
        assert state["trainer"] is restored and state["data"] is data  # in place, not replaced
        assert (restored.step, restored.tokens_seen) == (7, 700)
        assert (data.position.epoch, data.position.consumed) == (1, GLOBAL_BATCH)
    assert sorted(samples(ranks[0]) + samples(ranks[1])) == sorted(reference)
    assert set(samples(ranks[0])).isdisjoint(samples(ranks[1]))


def test_checkpoint_with_the_position_under_trainer_still_loads(tmp_path):
    """The layout CountersState wrote (trainer.epoch, trainer.samples_in_epoch) loads into TrainProgress and
    StepBatches."""
    old = CountersState(step=9, epoch=1, tokens_seen=900, samples_in_epoch=2 * GLOBAL_BATCH)
    checkpointer(tmp_path).save(9, {"trainer": old})
    saved_keys = dcp.FileSystemReader(str(tmp_path / step_dir_name(9))).read_metadata().state_dict_metadata
    assert "trainer.samples_in_epoch" in saved_keys and "data.samples_in_epoch" not in saved_keys

    progress, data = TrainProgress(), batches()
    checkpointer(tmp_path).load({"trainer": progress, "data": data})
    assert (progress.step, progress.tokens_seen) == (9, 900)
    assert (data.position.epoch, data.position.consumed) == (1, 2 * GLOBAL_BATCH)
    counters, beside = CountersState(), batches()  # a loop that keeps CountersState and adds its StepBatches
    checkpointer(tmp_path).load({"trainer": counters, "data": beside})
    assert counters == old and (beside.position.epoch, beside.position.consumed) == (1, 2 * GLOBAL_BATCH)
    expected = batches()
    for _ in range(6 + 2):  # one epoch of 6 steps, then two steps into the next
        samples(expected)
    assert samples(data) == samples(expected)

