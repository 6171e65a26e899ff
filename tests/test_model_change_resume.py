"""A resume whose model differs in shape from the checkpoint's is refused, not loaded in part."""

from __future__ import annotations

import subprocess
import sys

import pytest

from meshrun.config import load_config
from meshrun.train.resuming import model_change_refusal


def _manifest(**model) -> dict:
    return {"step": 10, "meta": {"config": {"model": {"arch": "llama", "dim": 64, "n_layers": 4, "n_heads": 4,
                                                      "n_kv_heads": 4, "ffn_dim": 176, "vocab_size": 256, **model}}}}


def test_fewer_blocks_than_the_checkpoint_are_refused_naming_the_option_to_give():
    model = load_config(None, ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=4",
                               "--model.ffn_dim=176", "--model.vocab_size=256", "--model.arch=llama"]).model
    refusal = model_change_refusal(_manifest(), model)
    assert refusal.startswith("the checkpoint of step 10 holds another model than this run builds (model.n_layers "
                              "4 -> 2): it would load only in part")
    assert "--model.n_layers=4" in refusal and "--fresh" in refusal


def test_the_same_shape_or_a_longer_sequence_or_an_unrecorded_value_resumes():
    model = load_config(None, ["--model.dim=64", "--model.n_layers=4", "--model.n_heads=4", "--model.n_kv_heads=4",
                               "--model.ffn_dim=176", "--model.vocab_size=256", "--model.arch=llama",
                               "--model.seq_len=512"]).model
    assert model_change_refusal(_manifest(seq_len=128), model) == ""
    assert model_change_refusal(_manifest(ffn_dim=0), model) == ""  # left to the named size when it was saved
    assert model_change_refusal({"step": 3, "meta": {}}, model) == ""  # a checkpoint without a config (Session)


@pytest.mark.slow
def test_meshrun_train_refuses_to_resume_four_blocks_into_two(tmp_path):
    run = tmp_path / "run"
    base = [sys.executable, "-m", "meshrun", "train", "--model.name=tiny", "--train.steps=2", "--train.eval_every=0",
            "--dist.device=cpu", f"--data.source={pytest.__file__}", f"--run.dir={run}"]
    first = subprocess.run([*base, "--model.n_layers=4"], capture_output=True, text=True, timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    again = subprocess.run([*base, "--model.n_layers=2", "--train.steps=4"], capture_output=True, text=True,
                           timeout=240)
    assert again.returncode != 0
    assert "holds another model than this run builds (model.n_layers 4 -> 2)" in again.stderr, again.stderr[-3000:]
    assert "Traceback" not in again.stderr
    more = subprocess.run([*base, "--model.n_layers=6", "--train.steps=4"], capture_output=True, text=True,
                          timeout=240)  # more blocks than the checkpoint's: refused before the load, not by a key
    assert more.returncode != 0
    assert "holds another model than this run builds (model.n_layers 4 -> 6)" in more.stderr, more.stderr[-3000:]
    assert "has no entry for" not in more.stderr
