"""Checkpoints in object storage (``s3://``, ``gs://``) against real servers on loopback: moto's S3 server and the GCS
emulator, through s3fs and gcsfs (no mock of either client).

Covered: the store's operations, fresh listings and the conditional create of COMPLETE, `ckpt verify` refusing
damage, fast one-line failures (closed endpoint, no credentials, unknown scheme), a 2-rank bitwise round trip with
sync and async saves and a resume at another world size, a rank SIGKILLed during a save, the server stopped
mid-run, the trainer, Session and `meshrun sample` on a bucket, doctor's checkpoint row, checkpoint.storage_options.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed
from object_servers import Server, free_port
from test_ckpt_support import Job, assert_same, checkpointer

from meshrun.ckpt import cli, storage
from meshrun.ckpt.errors import CheckpointError
from meshrun.ckpt.folder import scan
from meshrun.env import ProcessPlacement

ENV = ProcessPlacement.detect({})
KINDS = [pytest.param(kind, marks=pytest.mark.skipif(bool(Server.available(kind)),
                                                      reason=Server.available(kind) or ""))
         for kind in ("s3", "gs")]


@pytest.fixture(scope="module")
def servers():
    started: dict[str, Server] = {}
    for kind in ("s3", "gs"):
        if Server.available(kind) is None:
            server = Server(kind, bucket=f"ckpt-{kind}")
            os.environ.update({k: v for k, v in server.env.items() if k.startswith("GCSFS")})  # before gcsfs loads
            server.start()
            started[kind] = server
    yield started
    for server in started.values():
        server.stop()


@pytest.fixture
def server(servers, request, monkeypatch) -> Server:
    """The server of the test's parameter, with its client environment set (spawned ranks inherit it)."""
    if request.param not in servers:
        pytest.skip(Server.available(request.param) or "server did not start")
    current = servers[request.param]
    for other in servers.values():
        for key, value in other.env.items():
            monkeypatch.setenv(key, value)
    storage.forget_clients()  # a fresh client: it reads the environment set above
    yield current
    storage.forget_clients()


def _object_names(server: Server, prefix: str) -> list[str]:
    fs = server.filesystem()
    return sorted(path.split(f"{server.bucket}/", 1)[1] for path in fs.find(f"{server.bucket}/{prefix}"))


@pytest.mark.parametrize("server", KINDS, indirect=True)
def test_store_operations_and_fresh_listings(server):
    folder = server.folder("ops")
    store = storage.store_for(folder)
    assert store.kind == "object" and store.list(folder) == []
    store.write(f"{folder}/a", b"one")
    assert store.read(f"{folder}/a") == b"one" and store.size(f"{folder}/a") == 3
    if server.kind == "s3":  # the GCS emulator ignores ifGenerationMatch (real GCS honours it)
        with pytest.raises(FileExistsError):
            store.write(f"{folder}/a", b"two", exclusive=True)
    # Another client (another node) adds and removes objects: the store must see it at once.
    other = server.filesystem()
    caching = server.filesystem(use_listings_cache=True)
    assert [i.name for i in store.list(folder)] == ["a"] and caching.ls(f"{server.bucket}/ops", detail=False)
    other.pipe(f"{server.bucket}/ops/b", b"x")
    other.rm(f"{server.bucket}/ops/a")
    assert [i.name for i in store.list(folder)] == ["b"]
    assert not store.exists(f"{folder}/a") and store.exists(f"{folder}/b")
    if server.kind == "s3":  # the hazard the store avoids: s3fs's listing cache still shows the old listing
        assert [p.rsplit("/", 1)[1] for p in caching.ls(f"{server.bucket}/ops", detail=False)] == ["a"]
    if server.kind == "s3":  # two writers publishing one step: the conditional create lets only the first in
        final = f"{folder}/step_0000009"
        store.write(f"{final}/attempt-aa/x", b"1")
        store.write(f"{final}/attempt-bb/x", b"2")
        store.publish(f"{final}/attempt-aa", final, b"manifest-sha256 0\n", replace=False)
        with pytest.raises(CheckpointError, match="exists already"):
            store.publish(f"{final}/attempt-bb", final, b"manifest-sha256 0\n", replace=False)
        assert storage.attempt_named(store.read(f"{final}/COMPLETE")) == "attempt-aa"
    store.delete(folder, recursive=True)
    assert store.list(folder) == []


@pytest.mark.parametrize("server", KINDS, indirect=True)
def test_verify_refuses_damage_in_a_bucket(server, capsys):
    folder = server.folder("verify")
    job = Job(ENV)
    job.train(1, data_seed=1)
    checkpointer(folder, ENV).save(1, job.state)
    step = f"{folder}/step_0000001"
    assert cli.main(["verify", step]) == 0
    attempt = [n for n in _object_names(server, "verify/step_0000001/") if n.endswith("/.metadata")][0]
    attempt = attempt.rsplit("/", 1)[0]
    fs, shard = server.filesystem(), f"{server.bucket}/{attempt}/__0_0.distcp"
    data = bytearray(fs.cat_file(shard))
    data[len(data) // 2] ^= 0x01
    fs.pipe(shard, bytes(data))
    capsys.readouterr()
    assert cli.main(["verify", step]) == 1
    assert f"{server.kind}://{server.bucket}/{attempt}/__0_0.distcp: sha256" in capsys.readouterr().out
    fs.pipe(f"{server.bucket}/{attempt}/extra.bin", b"stray")
    assert cli.main(["verify", step, "--no-checksums"]) == 1
    assert "extra.bin: not listed in the manifest" in capsys.readouterr().out
    fs.rm(f"{server.bucket}/verify/step_0000001/COMPLETE")
    assert cli.main(["verify", step]) == 1
    assert "COMPLETE: missing; the save did not finish" in capsys.readouterr().out
    assert checkpointer(folder, ENV).load(Job(ENV).state) is None  # nothing a COMPLETE names: a fresh start
    assert cli.main(["ls", folder]) == 0 and "INCOMPLETE" in capsys.readouterr().out


@pytest.mark.parametrize("server", KINDS[:1], indirect=True)
def test_unreachable_endpoint_and_unknown_scheme_fail_fast(server, monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    storage.forget_clients()
    started = time.monotonic()
    with pytest.raises(CheckpointError) as err:
        checkpointer(server.folder("down"), ENV).save(1, Job(ENV).state)
    assert time.monotonic() - started < 15
    assert str(err.value).startswith(f"checkpoint.dir={server.folder('down')}: cannot reach the object store at "
                                     "http://127.0.0.1:") and "AWS_ENDPOINT_URL" in str(err.value)
    if Server.available("gs") is None:  # gcsfs retries a closed port for ~30 s; the probe does not wait for it
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{free_port()}")
        storage.forget_clients()
        started = time.monotonic()
        with pytest.raises(CheckpointError, match=r"^gs://b/ck: cannot reach the object store at http://127"):
            storage.store_for("gs://b/ck").probe("gs://b/ck")
        assert time.monotonic() - started < 10
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=r"^ftp://host/ck: checkpoint locations are local paths, s3:// or gs://"):
        checkpointer("ftp://host/ck", ENV)
    assert list(tmp_path.iterdir()) == []  # and no local folder named 'ftp:' or 's3:'


def test_missing_credentials_line(servers, monkeypatch, tmp_path, capsys):
    if "s3" not in servers:
        pytest.skip(Server.available("s3") or "server did not start")
    monkeypatch.setenv("AWS_ENDPOINT_URL", servers["s3"].url)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    storage.forget_clients()
    try:
        assert cli.main(["ls", servers["s3"].folder("run")]) == 1
    finally:
        storage.forget_clients()
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"meshrun ckpt ls: {servers['s3'].folder('run')}: no usable credentials for s3://")
    assert "AWS_ACCESS_KEY_ID" in line and len(line.splitlines()) == 1


def _ddp(model):
    return torch.nn.parallel.DistributedDataParallel(model)


def _round_trips(rank: int, world_size: int, folders: list[str]) -> dict:
    """Per folder: train, sync save, train, async save, train, resume (auto): bitwise what was saved."""
    env, out = ProcessPlacement.detect(), {}
    for folder in folders:
        job = Job(env, seed=0, wrap=_ddp)
        job.train(1, data_seed=10 + rank)
        ckpt = checkpointer(folder, env, async_save=True)
        ckpt.save(1, job.state, final=True)  # final: a sync save
        job.train(1, data_seed=20 + rank)
        ckpt.save(2, job.state)  # async: returns after staging
        saved = job.snapshot()
        job.train(1, data_seed=30 + rank)
        manifest = ckpt.load(job.state)
        ckpt.close()
        out[folder] = {"step": manifest["step"], "async": manifest["async_save"], "saved": saved,
                       "loaded": job.snapshot()}
    return out


@pytest.mark.slow
def test_two_ranks_round_trip_and_resume_at_another_world_size(servers, monkeypatch):
    if not servers:
        pytest.skip("neither moto_server nor gcp-storage-emulator is installed")
    for server in servers.values():
        for key, value in server.env.items():
            monkeypatch.setenv(key, value)
    storage.forget_clients()
    folders = [server.folder("two") for server in servers.values()]
    results = run_distributed(_round_trips, 2, folders, timeout=300)
    for folder in folders:
        for result in results:
            assert result[folder]["step"] == 2 and result[folder]["async"]
            assert_same(result[folder]["loaded"], result[folder]["saved"])
        # 2 -> 1: the same state in one process (resharded load of the DDP checkpoint)
        job = Job(ENV, seed=7)
        manifest = checkpointer(folder, ENV).load(job.state)
        assert manifest["step"] == 2 and manifest["world_size"] == 2
        assert_same(job.snapshot(), results[0][folder]["saved"])
    storage.forget_clients()


_KILLED_RANK = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    import torch, torch.distributed as dist
    from test_ckpt_support import Job, checkpointer
    from meshrun.env import ProcessPlacement

    dist.init_process_group("gloo")
    env = ProcessPlacement.detect()
    job = Job(env, wrap=torch.nn.parallel.DistributedDataParallel)
    ckpt = checkpointer({folder!r}, env, timeout_s=120)
    job.train(1, data_seed=1)
    ckpt.save(1, job.state)
    job.train(1, data_seed=2)
    if env.rank == 1:  # its shards of step 2 are uploaded (dcp.save returned); killed before they are checked
        ckpt._hash_own_files = lambda tmp, written: os.kill(os.getpid(), signal.SIGKILL)
    ckpt.save(2, job.state)
""")


@pytest.mark.slow
@pytest.mark.parametrize("server", KINDS[:1], indirect=True)
def test_rank_killed_during_a_save_leaves_the_previous_checkpoint(server, tmp_path):
    folder = server.folder("killed")
    script = tmp_path / "job.py"
    script.write_text(_KILLED_RANK.format(tests=str(Path(__file__).parent), folder=folder))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "--max-restarts", "0", str(script)], capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0 and "Signal 9 (SIGKILL) received" in proc.stderr, proc.stderr[-3000:]
    attempts = [n for n in _object_names(server, "killed/step_0000002/") if n.endswith(".distcp")]
    assert attempts, "rank 1's shards of step 2 were uploaded"
    assert not storage.store_for(folder).exists(f"{folder}/step_0000002/COMPLETE")
    job = Job(ENV, seed=3)
    ckpt = checkpointer(folder, ENV)
    manifest = ckpt.load(job.state)
    assert manifest["step"] == 1 and any("is an unfinished save" in note for note in ckpt.notes)
    # The next job's first save publishes step 2 anew and collects the killed attempt.
    ckpt.save(2, job.state)
    entries = scan(folder)
    assert [(e.step, e.kind) for e in entries] == [(1, "complete"), (2, "complete")]
    names = _object_names(server, "killed/step_0000002/")
    assert len({n.split("/")[2] for n in names if "/attempt-" in f"/{n}"}) == 1, names


@pytest.mark.parametrize("server", KINDS[:1], indirect=True)
def test_server_stopped_mid_run(server):
    folder = server.folder("outage")
    job = Job(ENV)
    job.train(1, data_seed=1)
    ckpt = checkpointer(folder, ENV)
    ckpt.save(1, job.state)
    job.train(1, data_seed=2)
    before = job.snapshot()
    server.stop()
    try:
        started = time.monotonic()
        with pytest.raises(CheckpointError) as err:
            ckpt.save(2, job.state)
        elapsed = time.monotonic() - started
    finally:
        server.start()  # the bucket is created again: moto keeps objects in memory only
    message = str(err.value)
    assert len(message.splitlines()) == 1 and elapsed < 10, (elapsed, message)
    assert f"{folder}: cannot reach the object store at {server.url}" in message, message
    assert_same(job.snapshot(), before)  # the training state is untouched
    job.train(1, data_seed=3)
    ckpt.save(3, job.state)  # the server is back: the next save works
    saved = job.snapshot()
    fresh = Job(ENV, seed=5)
    assert checkpointer(folder, ENV).load(fresh.state)["step"] == 3
    assert_same(fresh.snapshot(), saved)


@pytest.mark.parametrize("server", KINDS, indirect=True)
def test_doctor_checkpoint_row_for_a_bucket(server, monkeypatch):
    from meshrun.diag import storage as doctor_storage
    from meshrun.diag.rows import FAIL, PASS

    folder = server.folder("doctor")
    for node in (0, 1):  # two nodes write their probe objects; each reads both back
        assert doctor_storage.write_probe(folder, "tok", node) is None
    assert doctor_storage.seen_probes(folder, "tok", 2) == (0, 1)
    facts = [doctor_storage.FolderFacts(node=n, host=f"h{n}", writable=True, error=None, free=None, seen=(0, 1))
             for n in (0, 1)]
    rows = doctor_storage.judge_folder(folder, facts, needed=10**6)
    assert [r.status for r in rows] == [PASS, PASS] and "object store" in rows[0].detail
    if server.kind == "s3":
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
        storage.forget_clients()
        error = doctor_storage.write_probe(folder, "tok", 0)
        assert error.startswith("cannot reach the object store at http://127.0.0.1:") and "AWS_ENDPOINT_URL" in error
        facts[1] = doctor_storage.FolderFacts(node=1, host="h1", writable=False, error=error, free=None)
        assert doctor_storage.judge_folder(folder, facts, needed=1)[0].status == FAIL


def test_storage_options_from_toml_and_overrides(tmp_path):
    from meshrun.config import ConfigError, load_config

    toml = tmp_path / "job.toml"
    toml.write_text('[checkpoint]\ndir = "s3://bucket/run/checkpoints"\n'
                    '[checkpoint.storage_options]\nendpoint_url = "http://127.0.0.1:9000"\n')
    job = load_config(toml)
    assert job.checkpoint.storage_options == {"endpoint_url": "http://127.0.0.1:9000"}
    again = tmp_path / "again.toml"
    again.write_text(job.to_toml())
    assert load_config(again).checkpoint.storage_options == job.checkpoint.storage_options
    options = '{"profile": "ckpt", "config_kwargs": {"connect_timeout": 3}}'
    job = load_config(None, [f"--checkpoint.storage_options={options}"])
    assert job.checkpoint.storage_options == {"profile": "ckpt", "config_kwargs": {"connect_timeout": 3}}
    with pytest.raises(ConfigError, match="checkpoint.storage_options=.*JSON object"):
        load_config(None, ["--checkpoint.storage_options=endpoint"])


@pytest.mark.parametrize("server", KINDS[:1], indirect=True)
def test_trainer_saves_and_resumes_through_a_bucket(server, tmp_path):
    """`meshrun train --checkpoint.dir=s3://...`: a job dies after step 4 (its checkpoint saved); the next resumes
    at 4 and ends bitwise where a job that ran 6 steps straight does (single process; every rank of a launched job
    takes the same code path)."""
    from test_resume import train, token_file

    data = (f"--data.source={token_file(tmp_path)}", "--data.val_fraction=0", "--model.seq_len=16",
            "--model.vocab_size=104", "--train.global_batch=4", "--train.micro_batch=4")
    bucket = (*data, f"--checkpoint.dir={server.folder('trainer')}")
    train(tmp_path / "a", 6, bucket, crash_after=4)
    assert [(e.step, e.kind) for e in scan(server.folder("trainer"))] == [(4, "complete")]
    assert not (tmp_path / "a" / "checkpoints").exists() and not any(tmp_path.glob("**/s3:"))
    resumed_losses, resumed, _ = train(tmp_path / "a", 6, bucket)
    straight_losses, straight, _ = train(tmp_path / "b", 6, (*data, "--checkpoint.interval_steps=0"))
    assert len(resumed_losses) == 2 and resumed_losses == straight_losses[4:]
    assert_same(resumed, straight)
    from meshrun import sample

    assert sample.main([server.folder("trainer"), "--config", str(tmp_path / "a" / "config.toml"), "--tokens", "3",
                        "--temperature", "0"]) == 0
    # no run directory above a bucket: the config the checkpoint carries is enough
    assert sample.main([server.folder("trainer"), "--tokens", "3"]) == 0


@pytest.mark.parametrize("server", KINDS, indirect=True)
def test_session_checkpoint_url(server):
    import meshrun

    session = meshrun.Session(seed=0, checkpoint=server.folder("session"))
    try:
        model = torch.nn.Linear(4, 4)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        assert session.save(3, model=model, optimizer=optimizer) == f"{server.folder('session')}/step_0000003"
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            model.weight.zero_()
        assert session.resume(model=model, optimizer=optimizer) == 3
        assert_same(model.state_dict(), saved)
    finally:
        session.close()


@pytest.mark.parametrize("server", KINDS[:1], indirect=True)
def test_sample_names_an_unreachable_store_in_one_line(server, monkeypatch, tmp_path, capsys):
    """`meshrun sample s3://... --config` with the server down: ckpt's one line, not botocore's traceback."""
    from meshrun import sample

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    storage.forget_clients()
    (tmp_path / "config.toml").write_text("[model]\nvocab_size = 256\n")
    started = time.monotonic()
    assert sample.main([server.folder("run1"), "--config", str(tmp_path / "config.toml"), "--tokens", "3"]) == 2
    assert time.monotonic() - started < 15
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"meshrun sample: error: {server.folder('run1')}: cannot reach the object store at "
                          "http://127.0.0.1:") and "AWS_ENDPOINT_URL" in err and "--config" in err
    assert cli.main(["ls", server.folder("run1")]) == 1  # the same words as `meshrun ckpt`
    ckpt_err = capsys.readouterr().err.strip()
    assert ckpt_err.split(": ", 1)[1] == err.split(": ", 2)[2]
    result = subprocess.run([sys.executable, "-m", "meshrun", "sample", server.folder("run1")], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr and "cannot reach" in result.stderr


@pytest.mark.parametrize("server", KINDS[:1], indirect=True)
def test_storage_options_of_a_config_reach_ckpt_and_sample(server, monkeypatch, tmp_path, capsys):
    """The endpoint only in checkpoint.storage_options (AWS_ENDPOINT_URL names a dead port): training uses it, and
    `ckpt ls|verify|export` and `sample` take it from --config, or from the run folder, which they follow to its
    bucket checkpoint.dir."""
    from test_resume import token_file, train

    from meshrun import sample

    monkeypatch.setattr(storage, "_options", {})  # registered options are per process: restored after the test
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    storage.forget_clients()
    folder, run = server.folder("run_so"), tmp_path / "so"
    train(run, 2, (f"--data.source={token_file(tmp_path)}", "--data.val_fraction=0", "--model.seq_len=16",
                   "--model.vocab_size=104", "--train.global_batch=4", "--train.micro_batch=4",
                   "--checkpoint.interval_steps=2", f"--checkpoint.dir={folder}",
                   f'--checkpoint.storage_options={{"endpoint_url": "{server.url}"}}'))
    assert [(e.step, e.kind) for e in scan(folder)] == [(2, "complete")]

    def fresh() -> None:  # each command as a new process starts: no options registered
        storage._options.clear()
        storage.forget_clients()

    fresh()
    capsys.readouterr()
    assert cli.main(["ls", folder]) == 1
    err = capsys.readouterr().err
    assert "cannot reach the object store" in err and "a --config job.toml" in err, err
    fresh()
    assert cli.main(["ls", folder, "--config", str(run / "config.toml")]) == 0
    assert "step_0000002" in capsys.readouterr().out
    fresh()
    assert cli.main(["ls", "--config", str(run / "config.toml")]) == 0  # no DIR: the config's checkpoint folder
    assert "step_0000002" in capsys.readouterr().out
    fresh()
    assert cli.main(["ls", str(run)]) == 0  # the run folder: its config.toml puts the checkpoints in the bucket
    out, err = capsys.readouterr()
    assert "step_0000002" in out and f"puts the checkpoints in {folder} (checkpoint.dir)" in err
    fresh()
    assert cli.main(["verify", str(run)]) == 0
    assert f"OK {folder}/step_0000002: step 2" in capsys.readouterr().out
    fresh()
    assert cli.main(["export", folder, "--config", str(run), "--to", str(tmp_path / "m.safetensors")]) == 0
    assert (tmp_path / "m.safetensors").is_file()
    fresh()
    assert sample.main([folder, "--config", str(run / "config.toml"), "--tokens", "3", "--temperature", "0"]) == 0
    fresh()
    assert sample.main([str(run), "--tokens", "3", "--temperature", "0"]) == 0
    assert f"# {folder}/step_0000002 (step 2)" in capsys.readouterr().err


@pytest.mark.parametrize("server", KINDS[:1], indirect=True)
def test_single_process_doctor_checks_a_bucket(server, monkeypatch, tmp_path, capsys):
    """`meshrun doctor --ckpt-dir s3://...` without a launcher: write, read back and delete a probe object."""
    from meshrun.diag import doctor

    folder = server.folder("doctor_here")
    assert doctor.main(["--ckpt-dir", folder]) == 0
    out = capsys.readouterr().out
    assert f"pass checkpoint folder: {folder}: writable, an object store (no free-space limit)" in out, out
    assert "0 B" not in out and "checked on this host only" in out
    assert _object_names(server, "doctor_here") == []  # the probe object is deleted
    monkeypatch.setattr(storage, "_options", {})
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    storage.forget_clients()
    assert doctor.main(["--ckpt-dir", folder]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert f"fail checkpoint folder: {folder}: node 0 (host " in out and "cannot reach the object store" in out
    assert "writable" not in out  # no pass row beside the failure
    job = tmp_path / "job.toml"  # the endpoint in the job's storage options
    job.write_text(f'[checkpoint]\ndir = "{folder}"\n[checkpoint.storage_options]\nendpoint_url = "{server.url}"\n')
    storage.forget_clients()
    assert doctor.main(["--config", str(job)]) == 0
    assert f"pass checkpoint folder: {folder}: writable, an object store (no free-space limit) for about" in \
        capsys.readouterr().out
