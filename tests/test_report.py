"""`meshrun report`, `runs` and `sample` on a real 2-rank CPU run (FSDP over gloo, rank 1 slowed on purpose).

One training run feeds every test here: the report's files and numbers, the straggler's row in the heatmap, the
page rendered by headless Chromium, and sampling from the FSDP-saved checkpoint on one process, checked against
the run's own validation loss.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from dist_utils import run_distributed
from meshrun.config import load_config
from meshrun.train.trainer import Trainer

pytest.importorskip("matplotlib", reason="meshrun report needs matplotlib (pip install -e '.[test]')")

SLOW_RANK_DELAY_S = 0.1
TRAIN_ARGS = ["--train.steps=12", "--train.log_every=3", "--train.eval_every=6", "--train.eval_samples=32",
              "--data.max_bytes=200000", "--parallel.dp_shard=2", "--checkpoint.interval_steps=6",
              "--run.progress=lines", "--health.straggler_threshold=0"]


def _train_worker(rank, world_size, run_dir):
    import torch

    torch.set_num_threads(1)  # 2 ranks on 2 cores, as `meshrun launch` sets OMP_NUM_THREADS=1
    trainer = Trainer(load_config(None, [f"--run.dir={run_dir}", *TRAIN_ARGS]))
    next_step = trainer.data.next_step

    def slowed():
        if rank == 1:
            time.sleep(SLOW_RANK_DELAY_S)  # stands for a slow disk on rank 1's node
        return next_step()

    trainer.data.next_step = slowed
    result = trainer.fit()
    trainer.close()
    if rank == 0:  # what `meshrun train` does at exit (train/cli.py), without its process handling
        from meshrun.train.summary import write_summary

        write_summary(run_dir, exit_reason="reached train.steps=12", status="finished")
    return result.val_loss


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("run")
    val_losses = run_distributed(_train_worker, 2, path)
    assert val_losses[0] == pytest.approx(val_losses[1], abs=0)  # one reduced number on every rank
    return path


@pytest.fixture(scope="module")
def report(run_dir):
    from meshrun.report.cli import write_report

    return write_report([run_dir], run_dir / "report", sample_tokens=16)


def _records(run_dir, kind):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == kind]


@pytest.mark.slow
def test_report_files_and_numbers(run_dir, report):
    page = report.read_text()
    for name in ("loss.svg", "lr.svg", "grad_norm.svg", "throughput.svg", "memory.svg", "timeline.svg",
                 "ranks_0.svg", "system_0.svg"):
        assert (report.parent / name).stat().st_size > 5000, name
        assert f'src="{name}"' in page
    assert "<th>MFU</th>" not in page and "MFU" not in (report.parent / "throughput.svg").read_text()  # CPU run
    assert "[train]" in page and "steps = 12" in page  # the run's config.toml
    assert "http://" not in page and "https://" not in page and "<script" not in page  # works offline, file://
    last = _records(run_dir, "train")[-1]
    shown = re.search(r'class="num final_train_loss" data-value="([^"]+)">([^<]+)<', page)
    assert float(shown.group(1)) == last["loss"] and shown.group(2) == f"{last['loss']:.4f}"
    assert "16 = 8 (B_local) x 2 (G) x 1 (N) x 1 (A)" in page
    assert "What the model writes" in page and "[step 12, step_0000012]" in page
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["tokens"] == 12 * 16 * 64
    assert summary["best_val_loss"] == min(r["loss"] for r in _records(run_dir, "eval"))
    assert summary["last_checkpoint_step"] == 12 and summary["restarts"] == 0


@pytest.mark.slow
def test_per_rank_timing_shows_the_slow_rank(run_dir):
    from meshrun.report.load import load_run
    from meshrun.report.plots import rank_matrix

    ranks = _records(run_dir, "ranks")
    assert [r["step"] for r in ranks] == [3, 6, 9, 12]  # one gathered record per log interval
    assert all(len(r["work_s"]) == 2 and len(r["data_s"]) == 2 for r in ranks)
    steps, matrix = rank_matrix(load_run(run_dir))  # what the heatmap draws, ms per step
    assert steps == [3, 6, 9, 12]
    # after the warm-up interval rank 1's row is the brighter one, by about its sleep on average (rank 0's forward
    # time jitters by tens of ms on a loaded 2-core machine, so single cells are compared only by order)
    later = range(1, 4)
    assert all(matrix[1][i] > matrix[0][i] for i in later), matrix
    gap_ms = sum(matrix[1][i] - matrix[0][i] for i in later) / len(later)
    assert gap_ms > 0.5 * SLOW_RANK_DELAY_S * 1000, matrix
    assert all(ranks[i]["data_s"][1] >= SLOW_RANK_DELAY_S > 10 * ranks[i]["data_s"][0] for i in later), ranks


@pytest.mark.slow
def test_sample_loads_the_fsdp_checkpoint_on_one_process(run_dir, capsys):
    import torch

    from meshrun.data.corpus import load_corpus
    from meshrun.data.loader import eval_batches
    from meshrun.data.sampler import TokenWindows
    from meshrun.sample import find_config, load_model, main, resolve_checkpoint

    step_dir = resolve_checkpoint(run_dir)
    job = find_config(step_dir, None)
    model, manifest = load_model(step_dir, job)
    assert manifest["layout"]["dp_shard"] == 2
    # reference: the run's last validation loss, over the same fixed windows, computed by 2 FSDP ranks
    corpus = load_corpus(job.data)
    val = TokenWindows(corpus.val, model.cfg.seq_len, model.cfg.vocab_size)
    loss_sum, tokens = 0.0, 0
    with torch.no_grad():
        for x, y in eval_batches(val, dp_rank=0, dp_size=1, micro_batch=8, samples=32, device=torch.device("cpu")):
            logits = model(x)
            loss_sum += torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
            tokens += y.numel()
    assert loss_sum / tokens == pytest.approx(_records(run_dir, "eval")[-1]["loss"], rel=1e-5)
    assert main([str(run_dir), "--prompt", "def ", "--tokens", "30", "--top-k", "5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("def ") and len(out.encode()) >= 30


@pytest.mark.slow
def test_runs_lists_the_run(run_dir, capsys):
    from meshrun.report.runs import main

    assert main([str(run_dir.parent), "--json"]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out) if r["run"] == str(run_dir)]
    assert rows[0]["status"] == "finished" and rows[0]["steps"] == 12 and rows[0]["last_checkpoint_step"] == 12
    assert "FSDP" in rows[0]["layout"]
    parallel = rows[0]["parallel"]  # the start record's layout as data, which the table's cell reads
    assert parallel["parallelisms"] == ["FSDP"] and (parallel["dp_shard"], parallel["world_size"]) == (2, 2)


@pytest.fixture(scope="session")
def chromium():
    """Debian's chromium, installed with apt-get when missing and this is root (the install time is printed)."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("chromium is not installed, and installing it needs root and apt-get, which this machine lacks")
    started = time.monotonic()
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            pytest.skip(f"`{' '.join(cmd)}` failed, so chromium is missing: {done.stderr.strip()[-300:]}")
    print(f"\ninstalled chromium with apt-get in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return shutil.which("chromium")


@pytest.mark.slow
def test_page_renders_in_headless_chromium(report, chromium, tmp_path):
    from matplotlib.image import imread

    shot = tmp_path / "page.png"
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--window-size=1000,2600", f"--screenshot={shot}", report.resolve().as_uri()],
                   capture_output=True, timeout=120, check=True)
    pixels = imread(shot)[:, :, :3]  # (H, W, 3) floats in [0, 1]
    saturation = pixels.max(axis=2) - pixels.min(axis=2)
    # text and tables are grey; only the plots' lines and the heatmap are coloured
    coloured = int((saturation > 0.3).sum())
    assert coloured > 3000, f"the screenshot has {coloured} coloured pixels: the plots did not render"
