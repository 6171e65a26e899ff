"""The end of a job on one node (launch/exit_barrier.py): torch's exit barrier on a real TCPStore, polled, and a real
c10d rendezvous whose heartbeats tell a launcher that died from one that is still busy."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

from meshrun.launch import exit_barrier
from meshrun.launch.args import parse_launch_args
from meshrun.launch.cli import main
from meshrun.launch.exit_barrier import ExitBarrierAgent, exit_barrier_agent
from meshrun.launch.net import free_port
from meshrun.launch.simulate import agent_command


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    """Each test's barrier starts from a launch of its own (the launcher resets it per launch)."""
    monkeypatch.setattr(exit_barrier, "STATE", exit_barrier.BarrierState())


def store_server() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))


def client(server: dist.TCPStore) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))


def static_handler(port: int):
    """torch's static rendezvous (no heartbeats): the barrier can only wait. Nothing connects until a round."""
    params = RendezvousParameters(backend="static", endpoint=f"127.0.0.1:{port}", run_id="t", min_nodes=2,
                                  max_nodes=2, rank=0)
    return rdzv_registry.get_rendezvous_handler(params)


def make_agent(handler, tmp_path: Path, *, timeout_s: float) -> ExitBarrierAgent:
    spec = WorkerSpec(role="trainer", local_world_size=1, entrypoint=sys.executable, args=("-c", "pass"),
                      rdzv_handler=handler)
    return ExitBarrierAgent(spec=spec, logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs")),
                            barrier_timeout_s=timeout_s)


def seated(agent: ExitBarrierAgent, store: dist.Store, *, rank: int, nodes: int) -> ExitBarrierAgent:
    """What torch's _rendezvous leaves behind for the static rendezvous: the round's store, rank and size."""
    agent._store = store
    agent._worker_group.group_rank, agent._worker_group.group_world_size = rank, nodes
    return agent


def timed_barrier(agent: ExitBarrierAgent) -> float:
    start = time.monotonic()
    agent._exit_barrier()
    return time.monotonic() - start


def lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("meshrun launch:")]


# --- plain waiting (the static rendezvous: no heartbeats) ----------------------------------------------------------


def test_every_node_arriving_ends_the_barrier_at_once_and_quietly(tmp_path, capsys):
    server = store_server()
    agents = [seated(make_agent(static_handler(server.port), tmp_path, timeout_s=30), client(server), rank=r,
                     nodes=2) for r in range(2)]
    other = threading.Thread(target=agents[1]._exit_barrier)
    other.start()
    took = timed_barrier(agents[0])
    other.join(timeout=10)
    assert not other.is_alive() and took < 3
    assert lines(capsys.readouterr().err) == []


def test_a_missing_node_is_waited_for_until_the_timeout_then_one_line_and_no_traceback(tmp_path, capsys,
                                                                                         monkeypatch):
    monkeypatch.setattr(exit_barrier, "NOTICE_AFTER_S", 0.5)
    server = store_server()
    agent = seated(make_agent(static_handler(server.port), tmp_path, timeout_s=2), client(server), rank=0, nodes=2)
    took = timed_barrier(agent)  # returns: torch's barrier also only logs a timeout
    err = capsys.readouterr().err
    assert 2 <= took < 4
    notice, timeout = lines(err)
    assert notice == ("meshrun launch: this node's workers finished; waiting up to 2 s (--exit-barrier-timeout) for "
                      "the launchers of 1 other node(s) to finish: group rank 1")
    assert timeout.startswith("meshrun launch: stopped waiting after --exit-barrier-timeout 2 s for the launchers of "
                              "1 other node(s) to finish: group rank 1; this node's workers finished")
    assert "Traceback" not in err


def test_timeout_zero_counts_this_node_in_and_leaves_without_a_word(tmp_path, capsys):
    server = store_server()
    agent = seated(make_agent(static_handler(server.port), tmp_path, timeout_s=0), client(server), rank=1, nodes=2)
    assert timed_barrier(agent) < 1
    assert lines(capsys.readouterr().err) == []
    assert server.add("torchelastic/agent/terminal_state/num_members", 0) == 1  # torch's counter: counted in


def test_a_signal_while_waiting_stops_the_barrier_as_in_torch(tmp_path):
    """torch's agent handler raises SignalException for SIGTERM/SIGINT; the barrier lets it through (and, polling,
    sees it within POLL_S, where torch's blocking store wait saw it only when the wait ended)."""
    def raise_signal(signum, frame):
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))

    server = store_server()
    agent = seated(make_agent(static_handler(server.port), tmp_path, timeout_s=30), client(server), rank=0, nodes=2)
    previous = signal.signal(signal.SIGUSR1, raise_signal)
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGUSR1))
    try:
        timer.start()
        start = time.monotonic()
        with pytest.raises(SignalException):
            agent._exit_barrier()
        assert time.monotonic() - start < 3
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, previous)
    assert agent._in_exit_barrier is False
    assert exit_barrier.STATE.entered  # the launcher's last line: the workers had finished before the signal


def test_a_store_that_went_away_ends_the_barrier_with_one_line(tmp_path, capsys):
    server = store_server()
    store = client(server)
    store.set_timeout(timedelta(seconds=2))
    agent = seated(make_agent(static_handler(server.port), tmp_path, timeout_s=30), store, rank=0, nodes=2)
    del server  # the store host's launcher ended: its server closes with the last reference
    took = timed_barrier(agent)
    err = capsys.readouterr().err
    assert took < 15
    assert lines(err)[-1].startswith("meshrun launch: stopped waiting for the other nodes' launchers after ")
    assert "the store no longer answers" in err and "Traceback" not in err


# --- the c10d rendezvous: heartbeats ------------------------------------------------------------------------------


def c10d_handler(port: int, run_id: str, *, nodes: int):
    """torch's c10d rendezvous handler, as torch's registry builds it, with heartbeats 1 s apart that expire after
    4 s (a live node's last heartbeat is up to 2 s old: torch skips a beat that comes early)."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    params = RendezvousParameters(backend="c10d", endpoint=f"127.0.0.1:{port}", run_id=run_id, min_nodes=nodes,
                                  max_nodes=nodes, local_addr="127.0.0.1", join_timeout=30, keep_alive_interval=1,
                                  keep_alive_max_attempt=4)
    return create_handler(store, C10dRendezvousBackend(store, run_id), params)


def rendezvous(agents: list[ExitBarrierAgent]) -> None:
    """Each agent's own torch _rendezvous, all at once, as separate launchers would run them."""
    errors: list[BaseException] = []

    def run(agent: ExitBarrierAgent) -> None:
        try:
            agent._rendezvous(agent._worker_group)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(a,)) for a in agents]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    if errors:
        raise errors[0]


@pytest.fixture
def c10d_agents(tmp_path):
    """Three nodes' agents after a real c10d round on loopback; their heartbeats stop at the end of the test."""
    server, run_id = store_server(), f"exit-barrier-{os.getpid()}-{time.monotonic_ns()}"
    agents = [make_agent(c10d_handler(server.port, run_id, nodes=3), tmp_path, timeout_s=60) for _ in range(3)]
    rendezvous(agents)
    yield sorted(agents, key=lambda a: a._worker_group.group_rank)
    for agent in agents:
        agent._worker_group.spec.rdzv_handler._stop_heartbeats()  # private: the handler's timer thread
    del server


def killed(agent: ExitBarrierAgent) -> None:
    """What `kill -9` of a launcher does to the rendezvous: its heartbeat thread stops (private handler method)."""
    agent._worker_group.spec.rdzv_handler._stop_heartbeats()


def test_the_round_records_every_node_by_group_rank(c10d_agents):
    nodes = c10d_agents[0]._round_nodes
    assert sorted(nodes) == [0, 1, 2]
    assert {node.addr for node in nodes.values()} == {"127.0.0.1"} and nodes == c10d_agents[2]._round_nodes


def test_missing_launchers_that_stopped_heart_beating_end_the_wait_early(c10d_agents, capsys, monkeypatch):
    # the heartbeats expire about 5 s in, when the notice would also come: only the ending line is checked here
    monkeypatch.setattr(exit_barrier, "NOTICE_AFTER_S", 60.0)
    me, dead_1, dead_2 = c10d_agents
    killed(dead_1)
    killed(dead_2)
    took = timed_barrier(me)  # heartbeats expire after 4 x 1 s; the barrier looks once per interval
    err = capsys.readouterr().err
    assert took < 20, err
    (line,) = lines(err)
    assert line.startswith("meshrun launch: stopped waiting after ")
    assert "the launcher on 127.0.0.1 (group rank 1, launcher pid" in line and "(group rank 2," in line
    assert "stopped heart-beating to the rendezvous" in line and "the job's result on this node stands" in line
    assert exit_barrier.STATE.dead_nodes == 2  # the store host's shutdown does not wait for them (launch/stores.py)


def test_a_launcher_that_counted_in_and_then_died_does_not_excuse_one_still_running(c10d_agents, capsys,
                                                                                    monkeypatch):
    """Node 1 finished and counted in before its launcher died; node 2's launcher lives, its workers still busy:
    node 0 must wait for node 2, not leave because one launcher is dead."""
    monkeypatch.setattr(exit_barrier, "NOTICE_AFTER_S", 1.0)
    me, finished_then_dead, busy = c10d_agents
    finished_then_dead._exit_barrier_timeout = 0  # counts in, leaves
    finished_then_dead._exit_barrier()
    killed(finished_then_dead)
    me._exit_barrier_timeout = 6
    took = timed_barrier(me)
    err = capsys.readouterr().err
    assert took >= 6, err
    notice, timeout = lines(err)
    assert notice.endswith("the launchers of 1 other node(s) to finish: 127.0.0.1 (group rank 2, launcher pid "
                           f"{os.getpid()})")
    assert timeout.startswith("meshrun launch: stopped waiting after --exit-barrier-timeout 6 s")


# --- torch's launcher builds meshrun's agent ------------------------------------------------------------------------


def test_torchs_launcher_builds_the_agent_with_the_timeout_while_a_launch_runs(tmp_path):
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.launcher import api

    spec = WorkerSpec(role="trainer", local_world_size=1, entrypoint=sys.executable, rdzv_handler=static_handler(1))
    with exit_barrier_agent(timeout_s=12.5):
        # the keyword arguments torch's launch_agent passes (2.8 passes the first four)
        agent = api.LocalElasticAgent(spec=spec, logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)),
                                      start_method="spawn", log_line_prefix_template=None)
    assert isinstance(agent, ExitBarrierAgent) and agent._exit_barrier_timeout == 12.5
    assert api.LocalElasticAgent is LocalElasticAgent
    # torch's launch_agent must look the name up in its module when it runs, or the swap above would not reach it
    assert "LocalElasticAgent" in api.launch_agent.__code__.co_names


# --- the option ---------------------------------------------------------------------------------------------------


def test_exit_barrier_timeout_option(tmp_path):
    assert parse_launch_args(["s.py"]).ns.exit_barrier_timeout == 300
    largs = parse_launch_args(["--exit-barrier-timeout", "30", "--nproc-per-node", "1", "s.py"])
    assert largs.ns.exit_barrier_timeout == 30 and "exit_barrier_timeout" in largs.given
    assert parse_launch_args(["--exit_barrier_timeout=0.5", "s.py"]).ns.exit_barrier_timeout == 0.5
    # --simulate-nodes' agents get it too
    assert "--exit-barrier-timeout" in agent_command(largs, index=0, nodes=2, port=29400, run_id="r")


@pytest.mark.parametrize("value", ["-1", "abc", "nan", "inf", ""])
def test_a_bad_exit_barrier_timeout_names_the_option_and_the_fix(value, capsys):
    assert main([f"--exit-barrier-timeout={value}", "train"]) == 2
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith(f"meshrun launch: --exit-barrier-timeout {value!r}: give a number of seconds, 0 or more")


# --- end to end: a launcher killed while its worker runs on -------------------------------------------------------

WORKER = '''
import os, sys, time
out, rank = sys.argv[1], os.environ["GROUP_RANK"]
sleep_s = float(os.environ.get("WORKER_SLEEP_S", "0"))
with open(os.path.join(out, f"started-{rank}"), "w") as f:
    f.write(f"{os.getpid()} {sleep_s}")
time.sleep(sleep_s)
open(os.path.join(out, f"done-{rank}"), "w").close()
'''


@pytest.mark.slow
def test_a_node_whose_peer_launcher_was_killed_exits_soon_and_says_why(tmp_path):
    """The user's walkthrough: node B's `meshrun launch` gets SIGKILL, its worker runs on and finishes; node A
    (hosting the store) must not sit 300 s in the exit barrier."""
    script, out = tmp_path / "worker.py", tmp_path / "out"
    script.write_text(WORKER)
    out.mkdir()
    port, run_id = free_port(), f"kill9-{os.getpid()}"

    def start(is_host: bool, sleep_s: float) -> tuple[subprocess.Popen, Path]:
        err = tmp_path / f"launcher-{int(is_host)}.err"
        command = [sys.executable, "-m", "meshrun", "launch", "--nnodes", "2", "--nproc-per-node", "1",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
                   "--rdzv-conf", f"is_host={int(is_host)},keep_alive_interval=1,keep_alive_max_attempt=4",
                   str(script), str(out)]
        env = {**os.environ, "WORKER_SLEEP_S": str(sleep_s)}
        with open(err, "w") as sink:
            return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=sink, env=env), err

    node_a, a_err = start(is_host=True, sleep_s=0)
    node_b, _ = start(is_host=False, sleep_s=6)
    orphan_pid = None
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and orphan_pid is None:
            for started in out.glob("started-*"):
                pid, sleep_s = started.read_text().split()
                orphan_pid = int(pid) if float(sleep_s) > 0 else orphan_pid
            time.sleep(0.1)
        assert orphan_pid is not None, a_err.read_text()
        node_b.kill()  # kill -9 of B's launcher; its worker sleeps on
        killed_at = time.monotonic()
        assert node_a.wait(timeout=120) == 0, a_err.read_text()
        # heartbeats expire in 4-5 s; the store host then waits up to 15 s for B's rendezvous shutdown (stores.py)
        assert time.monotonic() - killed_at < 45
        err = a_err.read_text()
        assert "stopped heart-beating to the rendezvous" in err and "Traceback" not in err, err
        while time.monotonic() < deadline and len(list(out.glob("done-*"))) < 2:
            time.sleep(0.2)
        assert len(list(out.glob("done-*"))) == 2  # the orphan finished its work
    finally:
        for proc in (node_a, node_b):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if orphan_pid is not None:
            try:
                os.kill(orphan_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
