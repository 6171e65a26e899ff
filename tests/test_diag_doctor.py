"""`meshrun doctor`: the local view, and the cross-node report under a 2-node gloo run."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import socket
import threading
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from meshrun.diag import doctor, doctor_checks, reach
from meshrun.diag.fingerprint import FingerprintMismatch, check_consistency
from meshrun.env import ProcessPlacement


def test_local_doctor_finds_a_store_at_the_endpoint(capsys):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # what a rendezvous serves
    assert doctor.main(["--endpoint", f"127.0.0.1:{store.port}", "--timeout", "2"]) == 0
    out = capsys.readouterr().out
    assert "interfaces" in out and "route to 127.0.0.1 (127.0.0.1): interface lo" in out
    assert f"127.0.0.1:{store.port} answers (TCP connect in " in out and "a torch store answered" in out
    del store


def test_local_doctor_says_not_a_torch_store_like_launch_does(capsys):
    # accepts TCP, then answers the store handshake with something else (an HTTP server on the port, say)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
                conn.recv(64)
                conn.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n" * 8)
                conn.close()
            except OSError:
                return

    threading.Thread(target=serve, daemon=True).start()
    port = server.getsockname()[1]
    try:
        assert doctor.main(["--endpoint", f"127.0.0.1:{port}", "--timeout", "2"]) == 1
    finally:
        server.close()
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert f"127.0.0.1 (127.0.0.1:{port}) accepts TCP but is not a torch store" in out, out
    assert "not a torch store (wrong reply to the store handshake)" in out and "answers (TCP" not in out


def test_local_doctor_fails_on_a_closed_port_and_a_bad_endpoint(capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: refused
        assert doctor.main(["--endpoint", f"127.0.0.1:{port}", "--timeout", "2"]) == 1
    assert f"cannot reach 127.0.0.1 (127.0.0.1:{port}): connection refused" in capsys.readouterr().out
    assert doctor.main(["--endpoint", "127.0.0.1:notaport"]) == 2


def _facts(node: int, host: str, address: str, gpus: tuple[str, ...] = ()) -> doctor_checks.NodeFacts:
    return doctor_checks.NodeFacts(rank=node, node_rank=node, local_rank=0, host=host, address=address,
                            address_why="route to master", gpus=gpus, nccl=True, env_vars={})


def _report(facts: list[doctor_checks.NodeFacts]) -> doctor_checks.DoctorReport:
    eps = [reach.Endpoint(node=f.node_rank, host=f.host, addr=f.address, port=1) for f in facts]
    ok = reach.Probe(True, None, 0.1)
    matrix = reach.ReachMatrix(endpoints=eps, rows=[[ok] * len(eps) for _ in eps])
    env = ProcessPlacement.detect({})
    return doctor_checks.DoctorReport(env=env, facts=facts, fingerprints=[], diffs=[], matrix=matrix)


def test_loopback_address_is_a_problem_only_across_hosts():
    across = _report([_facts(0, "a", "10.1.0.1"), _facts(1, "b", "127.0.0.1")])
    doctor_checks.judge(across)
    assert across.problems and across.problems[0].startswith("node 1 (host b) would be reached at loopback")
    one_host = _report([_facts(0, "a", "127.0.0.1"), _facts(1, "a", "127.0.0.1")])
    doctor_checks.judge(one_host)
    assert one_host.problems == []


def test_different_gpus_per_node_are_noted():
    report = _report([_facts(0, "a", "10.1.0.1", ("H100",) * 8), _facts(1, "b", "10.1.0.2", ("H100",) * 4)])
    doctor_checks.judge(report)
    assert report.problems == [] and "nodes see different GPUs" in report.notes[0]


def _doctor_worker(rank: int, world_size: int, scripts: list[str]):
    # each rank plays one node (node rank = rank), as `meshrun launch --nnodes 2 --nproc-per-node 1` would
    os.environ.update({"GROUP_RANK": str(rank), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    env = ProcessPlacement.detect()
    try:
        check_consistency(env=env, strict=True, script=scripts[rank])
        strict_error = None
    except FingerprintMismatch as exc:
        strict_error = str(exc)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_consistency(env=env, strict=False, script=scripts[rank])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = doctor.main(["--script", scripts[rank], "--timeout", "2", "--wait", "60",
                            "--json", str(Path(scripts[0]).parent / "doctor.json")])
    return strict_error, [str(w.message) for w in caught], code, out.getvalue()


@pytest.mark.slow
def test_two_nodes_with_different_entry_scripts(tmp_path):
    scripts = [tmp_path / "train_a.py", tmp_path / "train_b.py"]
    scripts[0].write_text("print('version 1')\n")
    scripts[1].write_text("print('version 2')\n")
    results = run_distributed(_doctor_worker, 2, [str(s) for s in scripts], timeout=180)
    host = socket.gethostname()
    for rank, (strict_error, warned, code, _) in enumerate(results):
        assert strict_error is not None, f"rank {rank} did not raise"
        first = strict_error.splitlines()[0]  # two nodes: no majority, so both scripts are shown and neither blamed
        assert first.startswith("code differs across nodes, no majority: make the nodes run the same code")
        assert f"node 0 (host {host}) has entry script hash " in first
        assert f"node 1 (host {host}) has entry script hash " in first
        assert code == 1
        assert bool(warned) == (rank == 0)  # non-strict: only rank 0 warns
    report = results[0][3]
    assert results[1][3] == ""  # only rank 0 prints
    assert "TCP reachability" in report
    assert len(re.findall(r"ok \d+\.\d ms", report)) == 4  # 2 x 2 matrix, every pair connects
    assert "all-reduce gloo: ok" in report and "sum correct on all 2 ranks" in report
    assert "1 problem(s):" in report and "code differs across nodes, no majority" in report
    written = json.loads((tmp_path / "doctor.json").read_text())  # rank 0's machine-readable report
    assert {r["check"]: r["status"] for r in written["rows"]} == {
        "socket interface": "pass", "clock skew": "pass", "GPUs per node": "pass", "GPU health": "pass"}
    if not torch.cuda.is_available():  # CPU ranks are not measured: no "cpu cpu" row, no CPU TFLOP/s
        assert written["health"] == [] and "per-device speed" not in report and "TFLOP/s" not in report
        assert "GPU health: no GPUs: nothing to measure" in report and "cpu cpu" not in report


def _doctor_with_a_missing_gloo_interface(rank: int, world_size: int) -> tuple[int, str]:
    os.environ["GLOO_SOCKET_IFNAME"] = "mrnone9"  # an interface no host has: doctor stands in for it
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = doctor.main(["--timeout", "2", "--wait", "60", "--no-gpu-health"])
    return code, " ".join(out.getvalue().split())  # rich wraps long lines


def test_communication_variables_show_the_users_gloo_interface_not_doctors_stand_in():
    """A GLOO_SOCKET_IFNAME this host lacks fails its row, and the variables line shows it as the user set it: the
    interface doctor's own group used instead is named as such, never as the user's setting."""
    [(code, out)] = run_distributed(_doctor_with_a_missing_gloo_interface, 1, init_pg=False, timeout=120)
    assert code == 1 and "GLOO_SOCKET_IFNAME=mrnone9: no interface mrnone9 on this node" in out, out
    line = re.search(r"communication variables \(same on every node\): (.*?) fail socket interface", out).group(1)
    assert re.match(r"GLOO_SOCKET_IFNAME=mrnone9[, ]", line), line
    stand_in = re.search(r"\(doctor's own group used (GLOO_SOCKET_IFNAME=\S+|no GLOO_SOCKET_IFNAME) instead\)$", line)
    assert stand_in and "mrnone9" not in stand_in.group(1), line
    if stand_in.group(1) != "no GLOO_SOCKET_IFNAME":  # the nodes table: the address came from the stand-in
        assert f"{stand_in.group(1)} -> " in out and "doctor's stand-in for mrnone9)" in out, out


def test_allreduce_check_reports_a_correct_sum_and_a_failing_backend():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        env = ProcessPlacement.detect({})
        good = doctor_checks.allreduce_check("gloo", lambda: (None, torch.device("cpu")), env=env)
        assert good.ok and good.detail == "4 MiB fp32: sum correct on all 1 ranks" and good.seconds > 0

        def broken():
            raise RuntimeError("NCCL error: unhandled system error\nmore detail")

        bad = doctor_checks.allreduce_check("nccl", broken, env=env)
        assert not bad.ok
        assert bad.detail == "4 MiB fp32: failed on 1 rank(s): rank 0: RuntimeError: NCCL error: unhandled system error"
    finally:
        dist.destroy_process_group()


def test_local_doctor_checks_the_checkpoint_folder(tmp_path, capsys):
    """Without a launcher --ckpt-dir is checked on this host (it used to be ignored); no size without --config."""
    folder = tmp_path / "ck"
    assert doctor.main(["--ckpt-dir", str(folder)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"pass checkpoint folder: {folder}: writable, at least " in out, out
    assert "checkpoint size unknown: pass --config or --ckpt-bytes" in out and "about 0 B" not in out
    assert folder.is_dir() and list(folder.iterdir()) == []  # the probe file is gone
    assert doctor.main(["--ckpt-dir", str(folder), "--ckpt-bytes", "1G"]) == 0
    assert "for about 1.0 GiB per checkpoint" in capsys.readouterr().out
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert doctor.main(["--ckpt-dir", str(blocker / "ck")]) == 1
    assert f"fail checkpoint folder: {blocker / 'ck'}" in " ".join(capsys.readouterr().out.split())
    assert doctor.main(["--config", str(tmp_path / "missing.toml")]) == 2
    assert capsys.readouterr().out.strip().splitlines()[0].startswith("meshrun doctor: --config ")
