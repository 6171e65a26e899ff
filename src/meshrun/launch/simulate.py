"""``--simulate-nodes K``: rehearse a K-node job on one machine.

Each simulated node is a separate ``meshrun launch`` process, so each runs a real torch elastic agent; they meet
in a real c10d rendezvous on loopback (agent 0 hosts the store). GROUP_RANK, cross-node groups and restarts
behave as on K hosts. Agents' lines are prefixed ``[agent i]``; the exit code is the first failing agent's. On a
GPU machine each agent gets its own GPUs (CUDA_VISIBLE_DEVICES), as separate hosts would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from typing import IO, Mapping

import torch

from meshrun.launch.args import LaunchArgs, LaunchUsageError, Target, check_target, parse_nnodes
from meshrun.launch.net import free_port
from meshrun.launch.rendezvous import parse_rdzv_conf
from meshrun.launch.run_record import record_killed_run, train_folders

GRACE_S = 5.0
"""After one agent fails, how long the others get to finish on their own before being stopped. Survivors whose
workers succeeded would otherwise wait in the exit barrier for the failed node until its heartbeats expire (about
20 s; launch/exit_barrier.py)."""
SIGNAL_WAIT_S = 60.0
"""After a forwarded Ctrl-C or SIGTERM, how long the agents get to stop on their own: each waits up to torch's
shutdown timeout (30 s) for its workers' final checkpoint."""
STOP_WAIT_S = 5.0
"""SIGTERM to SIGKILL. An agent blocked inside a store call (exit barrier, rendezvous) only sees signals when the
call returns, and such an agent has no live workers to leave behind."""

_FIXED_BY_SIMULATION = {"rdzv_endpoint": "--rdzv-endpoint", "master_addr": "--master-addr",
                        "master_port": "--master-port", "node_rank": "--node-rank", "standalone": "--standalone",
                        "local_addr": "--local-addr"}


def simulate(largs: LaunchArgs) -> int:
    """Start K agents on loopback, stream their output with a prefix, and return the first failure's code."""
    nodes = largs.ns.simulate_nodes
    _check_options(largs, nodes)
    check_target(largs.target)
    port, run_id = free_port(), f"sim-{uuid.uuid4().hex[:8]}"
    commands = [agent_command(largs, index=i, nodes=nodes, port=port, run_id=run_id) for i in range(nodes)]
    visible = _visible_gpus()
    slices = split_gpus(nodes=nodes, nproc=str(largs.ns.nproc_per_node), visible=visible)
    print(f"meshrun launch: simulating {nodes} nodes on this host as {nodes} elastic agents, c10d rendezvous at "
          f"127.0.0.1:{port} (agent 0 hosts the store); each agent prints its own plan below.",
          file=sys.stderr, flush=True)
    threads = threads_note(nodes=nodes, nproc=str(largs.ns.nproc_per_node), environ=os.environ)
    if threads:
        print(f"  threads     {threads}", file=sys.stderr, flush=True)
    if slices:
        print("  GPUs        " + "; ".join(f"agent {i}: CUDA_VISIBLE_DEVICES={s}" for i, s in enumerate(slices)),
              file=sys.stderr, flush=True)
    elif visible:
        print(f"  note        {len(visible)} GPU(s) for {nodes} x {largs.ns.nproc_per_node} workers: the simulated "
              "nodes share GPUs, which NCCL refuses (two ranks on one GPU); use fewer workers or gloo.",
              file=sys.stderr, flush=True)
    if largs.ns.dry_run:
        for i, command in enumerate(commands):
            print(f"[agent {i}] {' '.join(command)}", file=sys.stderr)
        return 0
    envs = [dict(os.environ, CUDA_VISIBLE_DEVICES=s) for s in slices] if slices else [None] * nodes
    return _run_agents(commands, envs, target=largs.target)


def split_gpus(*, nodes: int, nproc: str, visible: list[str]) -> list[str] | None:
    """Give each simulated node its own GPUs, as separate hosts would have: ['0,1', '2,3'] for 2 x 2 on 4 GPUs.

    None when there are no GPUs, when --nproc-per-node is not a number, or when there are too few to split.
    """
    if not visible or not nproc.isdigit() or nodes * int(nproc) > len(visible):
        return None
    per_node = int(nproc)
    return [",".join(visible[i * per_node:(i + 1) * per_node]) for i in range(nodes)]


def threads_note(*, nodes: int, nproc: str, environ: Mapping[str, str]) -> str:
    """What the header says about OMP_NUM_THREADS: every agent's plan sets it to 1 for its workers when several
    share this host and the caller set none (rendezvous._choose_thread_env); '' when nothing is set."""
    if "OMP_NUM_THREADS" in environ:
        return f"OMP_NUM_THREADS={environ['OMP_NUM_THREADS']} in every worker (yours)"
    if not nproc.isdigit() or nodes * int(nproc) < 2:
        return ""
    return (f"OMP_NUM_THREADS=1 in every worker: {nodes} x {nproc} workers share this host's {os.cpu_count() or '?'} "
            "cores, and each would otherwise start a thread per core (torchrun sets 1 for several workers per node "
            "too); set OMP_NUM_THREADS to choose")


def _visible_gpus() -> list[str]:
    count = torch.cuda.device_count()  # creates no CUDA context; the agents are fresh processes anyway
    if count == 0:
        return []
    listed = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return listed[:count] if listed else [str(i) for i in range(count)]


def _run_agents(commands: list[list[str]], envs: list[dict[str, str] | None], *, target: Target) -> int:
    """Run the agents to the end. After a second Ctrl-C, summary.json goes in a ``train`` ``target``'s run folder if
    no agent (nor worker) could write it."""
    began_at = time.time()  # to tell this launch's records from earlier ones
    agents: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    stop = _Forward(agents)
    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        for i, (command, env) in enumerate(zip(commands, envs)):
            # a session of its own: a terminal's Ctrl-C reaches this process only, which forwards it once
            agent = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
                                     env=env, start_new_session=True)
            agents.append(agent)
            if stop.signum is not None:  # a signal came while the agents were starting
                agent.send_signal(stop.signum)
            pumps += [_pump(agent.stdout, sys.stdout, f"[agent {i}] "), _pump(agent.stderr, sys.stderr, f"[agent {i}] ")]
        code = _wait(agents, stop)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _stop(agents)
        for pump in pumps:
            pump.join(timeout=5)
    if stop.signum is not None:
        name = "Ctrl-C (SIGINT)" if stop.signum == signal.SIGINT else signal.Signals(stop.signum).name
        killed = stop.count > 1 and stop.signum == signal.SIGINT
        done = (record_killed_run(train_folders(target), since=began_at).outcome() if killed
                else "forwarded to every agent, whose workers saved a checkpoint")
        print(f"meshrun launch: {name}: {done}; exit code {128 + stop.signum}.", file=sys.stderr, flush=True)
        return 128 + stop.signum
    return code


class _Forward:
    """The signal handler while agents run: each SIGINT/SIGTERM goes to every agent, as a terminal or a scheduler
    would send it to each node's launcher. An agent forwards the first to its workers (they save a checkpoint and
    stop); a second Ctrl-C makes it kill them at once. The wait for the agents then ends after SIGNAL_WAIT_S
    (STOP_WAIT_S after a second Ctrl-C)."""

    def __init__(self, agents: list[subprocess.Popen]):
        self.agents, self.signum, self.count, self.deadline = agents, None, 0, None

    def __call__(self, signum: int, frame: object) -> None:
        self.signum = self.signum or signum
        self.count += 1
        repeat = self.count > 1 and signum == signal.SIGINT
        self.deadline = time.monotonic() + (STOP_WAIT_S if repeat else SIGNAL_WAIT_S)
        for agent in self.agents:
            if agent.poll() is None:
                agent.send_signal(signum)

def agent_command(largs: LaunchArgs, *, index: int, nodes: int, port: int, run_id: str) -> list[str]:
    """The ``meshrun launch`` line of simulated node ``index``: the user's options plus a fixed rendezvous."""
    conf = parse_rdzv_conf(largs.ns.rdzv_conf if "rdzv_conf" in largs.given else "")
    conf["is_host"] = "1" if index == 0 else "0"
    target = [largs.ns.training_script, *largs.ns.training_script_args]
    return [sys.executable, "-u", "-m", "meshrun", "launch", *largs.option_tokens,
            "--simulate-nodes", "0", "--nnodes", str(nodes), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
            "--rdzv-conf", ",".join(f"{k}={v}" for k, v in conf.items()), *target]


def _check_options(largs: LaunchArgs, nodes: int) -> None:
    for dest, flag in _FIXED_BY_SIMULATION.items():
        if dest in largs.given:
            raise LaunchUsageError(f"--simulate-nodes {nodes} sets {flag} itself (loopback rendezvous); drop {flag}.")
    if "nnodes" in largs.given and parse_nnodes(largs.ns.nnodes) != (nodes, nodes):
        raise LaunchUsageError(f"--simulate-nodes {nodes} with --nnodes {largs.ns.nnodes}: drop --nnodes "
                               f"(the simulation runs exactly {nodes} nodes).")
    if "rdzv_backend" in largs.given and largs.ns.rdzv_backend != "c10d":
        raise LaunchUsageError(f"--simulate-nodes rehearses the c10d rendezvous; drop --rdzv-backend "
                               f"{largs.ns.rdzv_backend}.")


def _pump(source: IO[str] | None, sink: IO[str], prefix: str) -> threading.Thread:
    def copy() -> None:
        assert source is not None  # Popen was given PIPE
        for line in source:
            sink.write(prefix + line)
            sink.flush()

    thread = threading.Thread(target=copy, daemon=True)
    thread.start()
    return thread


def _wait(agents: list[subprocess.Popen], stop: _Forward) -> int:
    """Wait for every agent; once one fails, give the rest GRACE_S, then stop them; after a forwarded signal, wait
    until ``stop.deadline``. Returns the first failure."""
    first_failure, deadline = 0, None
    while None in [agent.poll() for agent in agents]:  # a list, so that every agent is polled
        if stop.deadline is not None:
            if time.monotonic() > stop.deadline:
                break
        elif first_failure == 0:
            failed = [(i, agent.returncode) for i, agent in enumerate(agents) if agent.returncode not in (None, 0)]
            if failed:
                (index, first_failure), deadline = failed[0], time.monotonic() + GRACE_S
                print(f"meshrun launch: agent {index} exited with code {first_failure}; the other agents get "
                      f"{GRACE_S:.0f}s to finish, then are stopped.", file=sys.stderr, flush=True)
        if deadline is not None and time.monotonic() > deadline:
            break  # survivors would wait in the exit barrier for the failed node's heartbeats to expire: stop them
        time.sleep(0.2)
    codes = [agent.returncode for agent in agents if agent.returncode not in (None, 0)]
    return first_failure or (codes[0] if codes else 0)


def _stop(agents: list[subprocess.Popen]) -> None:
    """SIGTERM the agents still running (torch's agent forwards it to its workers), then SIGKILL stragglers."""
    for agent in agents:
        if agent.poll() is None:
            agent.terminate()
    for agent in agents:
        try:
            agent.wait(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
