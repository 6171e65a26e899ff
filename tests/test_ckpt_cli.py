"""`meshrun ckpt ls / verify / export`, run in-process through the dispatcher."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from test_ckpt_support import Job, checkpointer, reseal

from meshrun.cli import main
from meshrun.ckpt.folder import COMPLETE, step_dir_name
from meshrun.ckpt.manifest import build_manifest
from meshrun.env import ProcessPlacement
from meshrun.models.gpt import GPT, gpt_config

ENV = ProcessPlacement.detect({})


@pytest.fixture
def folder(tmp_path):
    job = Job(ENV)
    ckpt = checkpointer(tmp_path / "run" / "checkpoints", ENV)
    job.train(1, data_seed=1)
    ckpt.save(1, job.state, meta={"epoch": 0, "tokens_seen": 1234})
    job.train(1, data_seed=2)
    ckpt.save(2, job.state, meta={"epoch": 0, "tokens_seen": 5678})
    shutil.copytree(tmp_path / "run" / "checkpoints" / step_dir_name(2), tmp_path / "run" / "checkpoints" /
                    ".step_0000003.tmp-0bad")
    return tmp_path / "run" / "checkpoints", job


def test_ls_shows_complete_and_unfinished(folder, capsys):
    path, _ = folder
    assert main(["ckpt", "ls", str(path.parent)]) == 0  # a run folder works too
    out = capsys.readouterr().out
    assert main(["ckpt", "list", str(path.parent)]) == 0 and capsys.readouterr().out == out  # other tools' word
    lines = [line for line in out.splitlines() if "step_000000" in line]
    assert len(lines) == 3
    assert "complete" in lines[0] and "dp_replicate=1" in lines[0] and "1,234" in lines[0]
    assert "complete" in lines[1] and "5,678" in lines[1]
    assert "unfinished" in lines[2] and ".step_0000003.tmp-0bad" in lines[2]
    assert main(["ckpt", "ls", str(path / "nowhere")]) == 2


def test_verify_passes_then_names_the_damaged_file(folder, capsys):
    path, _ = folder
    assert main(["ckpt", "verify", str(path / step_dir_name(2))]) == 0
    assert "OK" in capsys.readouterr().out
    shard = path / step_dir_name(2) / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[300] ^= 1
    shard.write_bytes(bytes(data))
    assert main(["ckpt", "verify", "--no-checksums", str(path / step_dir_name(2))]) == 0, "same size"
    assert main(["ckpt", "verify", str(path / step_dir_name(2))]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "__0_0.distcp: sha256" in out
    (path / step_dir_name(1) / COMPLETE).unlink()
    assert main(["ckpt", "verify", str(path / step_dir_name(1))]) == 1
    assert "COMPLETE: missing" in capsys.readouterr().out


def test_export_loads_into_a_fresh_model(folder, tmp_path, capsys):
    path, job = folder
    out = tmp_path / "export" / "model.safetensors"
    assert main(["ckpt", "export", str(path / step_dir_name(2)), "--to", str(out)]) == 0
    assert "from step 2" in capsys.readouterr().out
    weights = load_file(str(out))
    assert not any(key.startswith(("optim", "model_optim")) for key in weights), "model weights only"
    fresh = GPT(gpt_config("tiny"))
    fresh.load_state_dict(weights)
    for key, value in job.model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    shard = path / step_dir_name(2) / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-1])
    assert main(["ckpt", "export", str(path / step_dir_name(2)), "--to", str(out)]) == 1
    assert "will not export a damaged checkpoint" in capsys.readouterr().err


def test_export_takes_a_run_folder_or_its_checkpoints_folder(folder, tmp_path, capsys):
    """As verify and sample do, export picks the newest complete checkpoint of a run folder or a checkpoints folder
    (step 2 here; the unfinished .tmp save of step 3 is passed over), and says which step it wrote."""
    path, _ = folder
    direct = tmp_path / "direct.safetensors"
    assert main(["ckpt", "export", str(path / step_dir_name(2)), "--to", str(direct)]) == 0
    capsys.readouterr()
    for given in (path.parent, path, f"{path}/"):
        out = tmp_path / "from_folder.safetensors"
        assert main(["ckpt", "export", str(given), "--to", str(out)]) == 0, capsys.readouterr().err
        said = capsys.readouterr().out
        assert f"from step 2 ({path / step_dir_name(2)}, the newest complete checkpoint in " in said, said
        assert load_file(str(out)).keys() == load_file(str(direct)).keys()
        assert all(torch.equal(a, load_file(str(direct))[k]) for k, a in load_file(str(out)).items())


def test_export_names_a_folder_that_holds_no_checkpoint(folder, tmp_path, capsys):
    """A folder that is neither a step directory, a checkpoints folder nor a run folder is named as such, not called
    a damaged checkpoint; a checkpoints folder without a complete save says that; a damaged step directory is still
    refused as damaged."""
    path, _ = folder
    out = tmp_path / "model.safetensors"
    other = tmp_path / "elsewhere"
    other.mkdir()
    assert main(["ckpt", "export", str(other), "--to", str(out)]) == 1
    first = capsys.readouterr().err.strip().splitlines()[0]
    assert first.startswith(f"meshrun ckpt export: {other}: not a checkpoint directory, a checkpoints folder or a "
                            "run folder") and "damaged" not in first, first
    for command in (["export"], ["verify"], ["ls"]):  # a path that is not there: a usage error, exit 2 from each
        extra = ["--to", str(out)] if command == ["export"] else []
        assert main(["ckpt", *command, str(tmp_path / "missing"), *extra]) == 2
        err = capsys.readouterr().err
        assert f"{tmp_path / 'missing'}: no such folder; give a checkpoint directory" in err or \
            f"{tmp_path / 'missing'} does not exist; give the checkpoint folder" in err, err
    (other / "notes.txt").write_text("")
    assert main(["ckpt", "verify", str(other / "notes.txt")]) == 2
    assert "notes.txt: a file, not a folder; give a checkpoint directory" in capsys.readouterr().err
    for step in (1, 2):
        (path / step_dir_name(step) / COMPLETE).unlink()
    assert main(["ckpt", "export", str(path.parent), "--to", str(out)]) == 1
    first = capsys.readouterr().err.strip().splitlines()[0]
    assert first.startswith(f"meshrun ckpt export: {path}: no complete checkpoint (3 step directories"), first
    assert main(["ckpt", "export", str(path / step_dir_name(2)), "--to", str(out)]) == 1
    assert "will not export a damaged checkpoint" in capsys.readouterr().err
    assert not out.exists()


class _Payload:
    """Unpickling this runs ``os.system``: what a crafted .metadata would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def craft_metadata(folder, marker):
    """Replace folder/.metadata with a pickle that creates ``marker``, and reseal the manifest so verify passes."""
    (folder / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    reseal(folder)


def test_crafted_metadata_cannot_run_code(folder, tmp_path, capsys):
    path, _ = folder
    step = path / step_dir_name(2)
    marker = tmp_path / "pwned"
    craft_metadata(step, marker)
    assert main(["ckpt", "verify", str(step)]) == 1, "the hashes match the recomputed manifest; verify must still " \
                                                     "refuse what a resume refuses"
    failed = capsys.readouterr().out
    assert f"FAILED {step / '.metadata'}: refers to the global posix.system" in failed, failed
    assert main(["ckpt", "export", str(step), "--to", str(tmp_path / "model.safetensors")]) == 1
    first = capsys.readouterr().err.strip().splitlines()[0]
    assert str(step / ".metadata") in first and "posix.system" in first, first
    assert not marker.exists() and not (tmp_path / "model.safetensors").exists()


def test_export_refuses_a_model_entry_that_is_not_a_tensor(tmp_path, capsys):
    """A weight stored as a pickled object would be left out of the export (the model then loads it randomly
    initialised): export refuses, naming the entry, as resume does."""
    folder = tmp_path / step_dir_name(1)
    model = GPT(gpt_config("tiny")).state_dict()
    model["norm.weight"] = model["norm.weight"].tolist()  # a non-tensor entry, as a crafted checkpoint has
    dcp.save({"model_optim": {"model": model}}, checkpoint_id=str(folder), no_dist=True)
    (folder / "manifest.json").write_text(json.dumps(build_manifest(
        step=1, files={}, world_size=1, layout={}, config_fingerprint="fp", code={}, meta={},
        state_kinds={"model_optim": "ModelOptimState"}, final=False, async_save=False, timings={})))
    reseal(folder)
    out = tmp_path / "model.safetensors"
    assert main(["ckpt", "export", str(folder), "--to", str(out)]) == 1
    assert "entry 'model_optim.model.norm.weight' is stored as a pickled object" in capsys.readouterr().err
    assert main(["ckpt", "verify", str(folder)]) == 1, "verify refuses what export and resume refuse"
    assert not out.exists()
