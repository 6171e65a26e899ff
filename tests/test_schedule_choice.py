"""parallel.pp_schedule=auto: interleaved 1F1B on GPUs for a pipeline alone where its layers and micro-batches allow
it, 1F1B elsewhere; the planner falls back to 1F1B where the step's samples do not split for it."""

from __future__ import annotations

import pytest

from meshrun.comm.schedule_choice import choose_pp_schedule
from meshrun.config import ParallelConfig


@pytest.mark.parametrize(("degrees", "on_gpu", "n_layers", "cuda_graphs", "expected"), [
    ({"pp": 2, "dp_replicate": 1}, True, 18, "auto", "interleaved1f1b"),  # the 1b model on 2 GPUs
    ({"pp": -1, "dp_replicate": 1}, True, 18, "auto", "interleaved1f1b"),  # -1: every rank a stage
    ({"pp": 2, "dp_replicate": 1, "dp_shard": -1}, True, 18, "auto", "interleaved1f1b"),  # -1 resolves to 1
    ({"pp": 2, "dp_replicate": 1}, False, 18, "auto", "1f1b"),  # CPU: not measured there
    ({"pp": 2, "dp_replicate": 1}, True, 3, "auto", "1f1b"),  # 4 stages need 4 layers
    ({"pp": 2, "dp_replicate": 1}, True, 18, "true", "1f1b"),  # graphs asked for: interleaved cannot run as graphs
    ({"pp": 2, "dp_replicate": 1, "pp_microbatches": 3}, True, 18, "auto", "1f1b"),  # not a multiple of pp
    ({"pp": 2, "tp": 2, "dp_replicate": 1}, True, 18, "auto", "1f1b"),  # TP with PP: measured with 1F1B only
    ({"pp": 2, "dp_replicate": 1, "dp_shard": 2}, True, 18, "auto", "1f1b"),  # FSDP2 with PP
    ({"pp": 1}, True, 18, "auto", "1f1b"),  # no pipeline
    ({"pp": 2, "dp_replicate": 1, "pp_schedule": "gpipe"}, True, 18, "auto", "gpipe"),  # given: kept
])
def test_auto_picks_interleaved_1f1b_for_a_pipeline_alone_on_gpus(degrees, on_gpu, n_layers, cuda_graphs, expected):
    chosen, note = choose_pp_schedule(ParallelConfig(**{"pp_schedule": "auto"} | degrees), n_layers=n_layers,
                                      on_gpu=on_gpu, world_size=2, cuda_graphs=cuda_graphs)
    assert chosen.pp_schedule == expected
    assert bool(note) == (expected == "interleaved1f1b" and degrees.get("pp_schedule", "auto") == "auto"), note


def test_a_degree_of_minus_one_counts_as_what_it_resolves_to():
    # on 4 ranks dp_shard=-1 beside pp=2 is FSDP2 over 2 ranks: measured with 1F1B only
    fsdp, _ = choose_pp_schedule(ParallelConfig(pp_schedule="auto", pp=2, dp_replicate=1, dp_shard=-1), n_layers=18,
                                 on_gpu=True, world_size=4)
    assert fsdp.pp_schedule == "1f1b"
    whole, note = choose_pp_schedule(ParallelConfig(pp_schedule="auto", pp=-1, dp_replicate=1), n_layers=18,
                                     on_gpu=True, world_size=4)
    assert whole.pp_schedule == "interleaved1f1b" and "interleaved1f1b" in note


def test_the_planner_falls_back_to_1f1b_where_the_samples_do_not_split():
    from meshrun.config_load import load_config
    from test_plan import make_plan

    even = make_plan("--gpus-per-node", "2", "--model", "1b", "--pp", "2", "--micro-batch", "8")
    assert even.dims.pp_schedule == "interleaved1f1b" and even.dims.pp_microbatches % 2 == 0
    odd = make_plan("--gpus-per-node", "2", "--model", "1b", "--pp", "2", "--micro-batch", "3",
                    "--pp-microbatches", "0")
    assert odd.dims.pp_schedule == "1f1b", odd.dims  # 3 samples: no micro-batch count that is a multiple of 2
    assert load_config(None, []).parallel.pp_schedule == "auto"
