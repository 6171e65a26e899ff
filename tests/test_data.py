"""Corpus loading and the distributed, resumable sampler (pure logic, no process group)."""

from collections import Counter

import numpy as np
import pytest

from meshrun.config import ConfigError, DataConfig
from meshrun.data.corpus import load_corpus
from meshrun.data.sampler import DataPosition, GlobalOrderSampler, TokenWindows


def windows(n_samples=96, seq_len=4):
    return TokenWindows(np.arange(n_samples * seq_len + 1) % 256, seq_len)


def rank_samples(dataset, world, *, epoch=0, global_batch=16, position=None):
    out = []
    for rank in range(world):
        sampler = GlobalOrderSampler(dataset, num_replicas=world, rank=rank, seed=7, global_batch=global_batch)
        sampler.set_position(position or DataPosition(epoch, 0))
        out.append(list(sampler))
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_shards_are_disjoint_and_cover_the_epoch(world):
    dataset = windows(100)  # 100 samples, global batch 16 -> 96 usable, 4 dropped tail samples
    shards = rank_samples(dataset, world)
    flat = [i for shard in shards for i in shard]
    assert len(flat) == len(set(flat)) == 96
    assert all(len(shard) == 96 // world for shard in shards)


def test_epochs_reshuffle_and_depend_only_on_seed_and_epoch():
    dataset = windows()
    assert rank_samples(dataset, 2, epoch=0) != rank_samples(dataset, 2, epoch=1)
    assert rank_samples(dataset, 2, epoch=1) == rank_samples(dataset, 2, epoch=1)
    # the global order is the same whatever the world size: step s takes the same 16 samples
    one = rank_samples(dataset, 1)[0]
    two = rank_samples(dataset, 2)
    for step in range(6):
        block = set(one[step * 16:(step + 1) * 16])
        assert block == set(two[0][step * 8:(step + 1) * 8]) | set(two[1][step * 8:(step + 1) * 8])


@pytest.mark.parametrize("before, after", [(4, 2), (2, 4), (2, 1)])
def test_resume_mid_epoch_at_another_world_size_repeats_and_skips_nothing(before, after):
    dataset = windows()
    seen = Counter()
    first = rank_samples(dataset, before)
    steps_done = 2
    for shard in first:
        seen.update(shard[: steps_done * 16 // before])
    for shard in rank_samples(dataset, after, position=DataPosition(0, steps_done * 16)):
        seen.update(shard)
    assert sorted(seen) == sorted(range(96)) and set(seen.values()) == {1}


def test_position_must_be_whole_global_batches():
    sampler = GlobalOrderSampler(windows(), num_replicas=2, rank=0, seed=0, global_batch=16)
    with pytest.raises(ValueError, match="not a whole number of global batches"):
        sampler.set_position(DataPosition(0, 8))


def test_windows_are_shifted_by_one():
    x, y = windows()[3]
    assert x.tolist() == [12, 13, 14, 15] and y.tolist() == [13, 14, 15, 16]


def test_stdlib_corpus_is_deterministic_and_split():
    cfg = DataConfig(max_bytes=400_000)
    a, b = load_corpus(cfg), load_corpus(cfg)
    assert a.fingerprint == b.fingerprint and len(a.train) > 0 and len(a.val) > 0
    assert len(a.train) + len(a.val) == 400_000 and a.vocab_size == 256


def test_text_and_token_files(tmp_path):
    (tmp_path / "t.txt").write_bytes(b"hello world " * 100)
    text = load_corpus(DataConfig(source=str(tmp_path / "t.txt"), val_fraction=0.1))
    assert len(text.val) == 120 and bytes(text.train[:5]) == b"hello"
    tokens = np.arange(1000, dtype=np.uint16) * 3
    tokens.tofile(tmp_path / "tok.bin")
    corpus = load_corpus(DataConfig(source=str(tmp_path / "tok.bin"), val_fraction=0.1))
    assert corpus.train.dtype == np.uint16 and len(corpus.train) == 900 and corpus.vocab_size == 2998


def test_token_file_of_a_partial_token_names_the_file_and_the_dtype(tmp_path):
    (tmp_path / "tok.bin").write_bytes(b"\x01\x00" * 10 + b"\x07")  # 21 bytes: not whole uint16 tokens
    with pytest.raises(ConfigError, match=r"data.source='.*tok.bin': 21 bytes is not a whole number of "
                                          r"data.token_dtype=uint16 tokens"):
        load_corpus(DataConfig(source=str(tmp_path / "tok.bin"), format="tokens"))


def test_missing_corpus_path_names_the_option(tmp_path):
    with pytest.raises(ConfigError, match=r"data.source='.*nope': no such file or folder"):
        load_corpus(DataConfig(source=str(tmp_path / "nope")))


def test_loader_workers_hand_out_the_same_batches_across_an_epoch_and_a_seek():
    """data.num_workers moves indexing and collation to worker processes; the micro-batches of every step, across
    an epoch boundary and after a seek to a saved position, are the ones the training process loads itself."""
    import torch

    from meshrun.data.loader import StepBatches

    def steps(num_workers, count, position=None):
        data = StepBatches(windows(40), dp_rank=1, dp_size=2, seed=3, micro_batch=2, grad_accum=2,
                           device=torch.device("cpu"), num_workers=num_workers)
        if position is not None:
            data.seek(position)
        return [[x.tolist() for x, _ in data.next_step()] for _ in range(count)], data.position

    in_process, position = steps(0, 7)  # 40 samples, global batch 8: an epoch is 5 steps
    assert steps(1, 7) == (in_process, position)
    assert steps(1, 3, position) == steps(0, 3, position)
