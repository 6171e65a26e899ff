"""Run one node's elastic agent: torch's ``elastic_launch`` with the decisions of :mod:`meshrun.launch.rendezvous`.

meshrun starts no process itself here: torch's agent spawns, watches and restarts the workers, and serves the
c10d rendezvous. What meshrun adds is before (the plan, a reachability probe with a deadline) and after (errors
that name the endpoint, the missing nodes or the failed rank).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable

from torch.distributed import DistError
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousTimeoutError
from torch.distributed.launcher.api import elastic_launch
from torch.distributed.run import config_from_args

from meshrun.ckpt.preemption import PREEMPTION_SIGNALS, PreemptionFlag, exit_code
from meshrun.launch import exit_barrier, stores
from meshrun.launch.stores import StoreAnswer, probe_store
from meshrun.launch.args import LaunchArgs, check_target
from meshrun.launch.net import LOCAL_ADDR_VAR, ProbeResult, probe_tcp
from meshrun.launch.rendezvous import LaunchPlan, apply_plan, format_plan, make_plan, parse_rdzv_conf
from meshrun.launch.run_record import record_killed_run, train_folders
from meshrun.placement import ENV_VAR as ENVIRONMENT_VAR

MIN_JOIN_TIMEOUT_S = 10
"""Join time left to a node that spent most of --rdzv-timeout waiting for the endpoint to come up."""


class LaunchError(RuntimeError):
    """The job could not start or complete its rendezvous. The first line names host, endpoint and the fix."""

    def __init__(self, message: str, *, hard_exit: bool = False):
        super().__init__(message)
        self.hard_exit = hard_exit
        """A thread is still blocked inside torch: the caller must leave with os._exit after printing."""


class _RestartNotice(logging.Filter):
    """torch's agent reports restarts at INFO, which torchrun hides. This filter on the agent's logger prints
    those in one line and lets through only what the logger showed before (``shown``: its previous level)."""

    def __init__(self, shown: int):
        super().__init__()
        self.shown = shown

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "will restart worker group" in message:
            print(f"meshrun launch: {message.strip()}; the workers resume from the newest complete checkpoint",
                  file=sys.stderr, flush=True)
        return record.levelno >= self.shown


def _announce_restarts() -> None:
    agent_log = logging.getLogger("torch.distributed.elastic.agent.server.api")
    if any(isinstance(f, _RestartNotice) for f in agent_log.filters):
        return
    agent_log.addFilter(_RestartNotice(shown=agent_log.getEffectiveLevel()))
    agent_log.setLevel(min(agent_log.getEffectiveLevel(), logging.INFO))


def launch(largs: LaunchArgs) -> int:
    """Plan, print, probe, then run torch's elastic agent for this node. Returns the job's exit code."""
    if largs.ns.environment:  # loaded by the parser; the workers (and --simulate-nodes' agents) load it again
        os.environ[ENVIRONMENT_VAR] = largs.ns.environment
    plan = make_plan(largs, environ=os.environ)
    check_target(plan.target)
    print(format_plan(plan), file=sys.stderr, flush=True)
    if largs.ns.dry_run:
        return 0
    if plan.probe_first:
        _probe_endpoint(plan, largs)
    os.environ.update(plan.env_set)  # the agent copies its environment into every worker
    if plan.local_addr:
        os.environ[LOCAL_ADDR_VAR] = plan.local_addr  # where per-node servers bind (the metrics endpoint)
    apply_plan(largs.ns, plan)
    if plan.backend == "c10d":  # torch's c10d handler, its servers listening on one address (launch/stores.py)
        stores.register()
        largs.ns.rdzv_backend = stores.BACKEND
    config, entrypoint, entry_args = config_from_args(largs.ns)
    _announce_restarts()
    forwarding = _forward_preemption_signals()
    if hasattr(config, "signals_to_handle"):  # torch >= 2.9 sets the variable from its config at launch
        config.signals_to_handle = os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"]
    started, began_at = time.monotonic(), time.time()  # began_at: to tell this launch's records from earlier ones
    try:
        # torch's agent, with an exit barrier that says what it waits for and gives up on dead launchers
        with exit_barrier.exit_barrier_agent(timeout_s=largs.ns.exit_barrier_timeout):
            elastic_launch(config=config, entrypoint=entrypoint)(*entry_args)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        verdict = _hang_verdict(exc)
        if verdict:
            print(f"meshrun launch: the hang watchdog ended the job (seen from {_host(plan)}): {verdict}",
                  file=sys.stderr, flush=True)
            return _exit_code(failure.exitcode)
        print(f"meshrun launch: worker rank {rank} (local rank {failure.local_rank} on {_host(plan)}) failed with "
              f"exit code {failure.exitcode}; its output is above. {len(exc.failures)} worker(s) failed on this "
              "node.", file=sys.stderr, flush=True)
        return _exit_code(failure.exitcode)
    except SignalException as exc:  # SIGTERM/SIGINT (scancel, Ctrl-C): torch's agent has stopped the workers
        name = signal.Signals(exc.sigval).name
        if exit_barrier.STATE.entered:  # the workers had succeeded: the signal ended the wait for other nodes only
            what = "Ctrl-C (SIGINT)" if exc.sigval == signal.SIGINT else name
            print(f"meshrun launch: {what} on {_host(plan)} while it waited for the other nodes' launchers; this "
                  "node's workers had finished, so its result stands; exit code 0.", file=sys.stderr, flush=True)
            return 0
        if exc.sigval in (*PREEMPTION_SIGNALS, signal.SIGINT):
            code = exit_code(name)
            what = "Ctrl-C (SIGINT)" if exc.sigval == signal.SIGINT else name
            done = (record_killed_run(train_folders(plan.target), since=began_at).outcome() if forwarding.ignored < 0
                    else "forwarded to the workers, which save a checkpoint and stop")
            print(f"meshrun launch: {what} on {_host(plan)}: {done}; exit code {code}.", file=sys.stderr, flush=True)
            return code
        print(f"meshrun launch: stopped by {name} on {_host(plan)}; workers were stopped.", file=sys.stderr,
              flush=True)
        return 128 + int(exc.sigval)
    except DistError as exc:  # the static backend's store: unreachable, or gone
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise LaunchError(f"rendezvous at {plan.endpoint} failed on {_host(plan)} after "
                          f"{time.monotonic() - started:.0f}s (--rdzv-timeout {plan.timeout_s}): "
                          f"{type(exc).__name__}: {first[:300]}; check that {plan.endpoint_host} is "
                          "the node-rank-0 host and that this node reaches it (`meshrun doctor`).") from None
    except RendezvousTimeoutError as exc:
        raise LaunchError(rendezvous_timeout_message(plan)) from exc
    except RendezvousError as exc:
        raise LaunchError(rendezvous_error_message(plan, exc, ran_s=time.monotonic() - started)) from exc
    finally:
        forwarding.restore()
    return 0


def _probe_endpoint(plan: LaunchPlan, largs: LaunchArgs) -> None:
    """Wait for the endpoint to accept TCP, then for a store to answer there, within --rdzv-timeout together."""
    result = probe_tcp(plan.endpoint_host, plan.endpoint_port, timeout_s=plan.timeout_s)
    if not result.ok:
        raise LaunchError(unreachable_message(plan, result))
    answer = probe_store(plan.endpoint_host, plan.endpoint_port,
                         timeout_s=max(1.0, plan.timeout_s - result.elapsed_s))
    if not answer.ok:
        raise LaunchError(not_a_store_message(plan, answer, result.elapsed_s), hard_exit=answer.abandoned)
    elapsed = result.elapsed_s + answer.elapsed_s
    print(f"{plan.label}  reached     {plan.endpoint} after {elapsed:.1f}s (a store answered)", file=sys.stderr, flush=True)
    if plan.backend == "c10d" and "join_timeout" not in parse_rdzv_conf(_user_conf(largs)):
        left = max(MIN_JOIN_TIMEOUT_S, int(plan.timeout_s - elapsed))
        plan.rdzv_conf["join_timeout"] = str(left)  # --rdzv-timeout bounds probe and join together


def _hang_verdict(exc: ChildFailedError) -> str:
    """The hang watchdog's verdict, from the error file of any worker it ended ('' when none was)."""
    for failure in exc.failures.values():
        message = failure.message  # torch keeps the error file's {"message": ..., "extraInfo": ...} as it is
        message = str(message.get("message", "")) if isinstance(message, dict) else str(message or "")
        if "HangVerdict" in message and "hang:" in message:
            return message[message.index("hang:"):]
    return ""


def rendezvous_error_message(plan: LaunchPlan, exc: BaseException, *, ran_s: float) -> str:
    """The launcher's line for a failed rendezvous. Where another host serves the store and no longer accepts
    connections, that host went away (its node died, or its launcher ended): say so, since no --rdzv-id or endpoint
    typo explains a job that had been running; otherwise the usual suspects of a rendezvous that never formed."""
    if plan.probe_first and not probe_tcp(plan.endpoint_host, plan.endpoint_port, timeout_s=3.0).ok:
        return (f"the rendezvous store at {plan.endpoint} stopped answering {ran_s:.0f}s into the job, seen from "
                f"{_host(plan)}: {plan.endpoint_host}, the node that hosts it, went away (its node died or its "
                "launcher ended), and no node can rejoin without it; restart the job with --rdzv-endpoint on a "
                f"surviving node (the newest checkpoint resumes it). ({_with_cause(exc)})")
    return (f"rendezvous at {plan.endpoint} failed on {_host(plan)}: {_with_cause(exc)}; check that every node uses "
            "the same --rdzv-endpoint and --rdzv-id.")


def _with_cause(exc: BaseException) -> str:
    """The error's first line, and what caused it where torch chained one ('(cause: None)' said nothing); torch's
    C++ frames that follow a store error's first line are left out."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    cause = exc.__cause__ or exc.__context__
    detail = str(cause).strip().splitlines()[0] if cause is not None and str(cause).strip() else ""
    if cause is None or (detail and detail.split("] ")[-1] in text):  # nothing to add to what the error says
        return text
    return f"{text} (cause: {type(cause).__name__}{f': {detail}' if detail else ''})"


def _forward_preemption_signals() -> PreemptionFlag:
    """Make SIGTERM and SIGUSR1 reach the workers once per preemption, and keep the agent waiting for their save.

    torch's agent handles only TORCHELASTIC_SIGNALS_TO_HANDLE (default SIGTERM,SIGINT,SIGHUP,SIGQUIT): SIGUSR1
    would kill this process, and each SIGTERM of a burst (slurmstepd sends two, 9 ms apart) raises again inside
    the agent's shutdown, cutting short its wait for the workers. So meshrun takes both signals out of the
    agent's list and raises the agent's own SignalException for the first one: the agent then sends that signal
    to every worker's process group and waits its shutdown timeout (30 s) before SIGKILL. Repeats within the
    grace window are ignored; a later one raises again (torch's behaviour).

    Ctrl-C (SIGINT) is forwarded the same way (the workers save and stop, exit code 130); a second Ctrl-C kills the
    workers at once (they run in sessions of their own, so the terminal's SIGINT reaches this process only), and
    marks the flag (``ignored`` < 0) so that the launcher writes summary.json in their place and its exit line says
    so (launch/run_record.py).
    """
    handled = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT").split(",")
    names = {signal.Signals(s).name for s in (*PREEMPTION_SIGNALS, signal.SIGINT)}
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = ",".join(n.strip() for n in handled if n.strip() not in names)
    flag = PreemptionFlag()

    def handler(signum: int, frame: object) -> None:
        if signum == signal.SIGINT and flag.is_set():  # a second Ctrl-C: stop now
            flag.ignored = -1
            for pid in _child_pids():
                try:
                    os.killpg(pid, signal.SIGKILL)  # each worker leads its own session (torch starts it so)
                except (ProcessLookupError, PermissionError):
                    pass
            return
        if flag.is_set() and flag.in_grace():
            flag.ignored += 1
            return
        sigval = signal.Signals(signum)
        flag.set(sigval.name)
        raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)

    flag.install((*PREEMPTION_SIGNALS, signal.SIGINT), handler)
    _keep_handler_when_the_agent_starts_workers(flag, handler)
    return flag


def _keep_handler_when_the_agent_starts_workers(flag: PreemptionFlag, handler: Callable[[int, object], None]) -> None:
    """torch 2.8 has no TORCHELASTIC_SIGNALS_TO_HANDLE: when its agent starts the workers it installs its own handler
    for SIGTERM, SIGINT, SIGHUP and SIGQUIT, replacing meshrun's, so a burst of SIGTERMs cut the workers' save short
    and a second Ctrl-C waited for it. The handler it installs is its module's ``_terminate_process_handler``; for
    the signals meshrun forwards that name now calls meshrun's (torch's own for the rest), until ``flag.restore``."""
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.launcher.api import LaunchConfig

    if hasattr(LaunchConfig, "signals_to_handle"):  # torch >= 2.9 leaves the signals meshrun took out of the list
        return
    torch_handler = api._terminate_process_handler
    ours = {signal.SIGINT, *PREEMPTION_SIGNALS}

    def either(signum: int, frame: object) -> None:
        (handler if signum in ours else torch_handler)(signum, frame)

    api._terminate_process_handler = either
    restore = flag.restore

    def restore_both() -> None:
        api._terminate_process_handler = torch_handler
        restore()

    flag.restore = restore_both  # type: ignore[method-assign]


def _child_pids() -> list[int]:
    """This process's children (the workers), from /proc."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                if int(handle.read().rsplit(")", 1)[1].split()[1]) == me:
                    found.append(int(entry))
        except (OSError, IndexError, ValueError):
            pass  # gone, or not ours to read
    return found


def unreachable_message(plan: LaunchPlan, result: ProbeResult) -> str:
    no_route = "check the address, and that both hosts share a network (`ip route`)"
    fix = {"connection refused": f"nothing listens on port {plan.endpoint_port} there yet: start `meshrun launch` "
                                 f"on {plan.endpoint_host} first (it hosts the store), or check the port",
           "timed out": "packets get no answer: check the address, and firewalls between the hosts",
           "no route to host": no_route, "network unreachable": no_route,
           }.get(result.error, "check the address, the port and firewalls")
    return (f"{_host(plan)} cannot reach the rendezvous endpoint {plan.endpoint}: {result.error} "
            f"(waited {result.elapsed_s:.0f}s, {result.attempts} attempts; --rdzv-timeout {plan.timeout_s}); "
            f"{fix}.")


def not_a_store_message(plan: LaunchPlan, answer: StoreAnswer, tcp_s: float) -> str:
    return (f"{_host(plan)}: rendezvous endpoint {plan.endpoint}: {answer.error} "
            f"(waited {tcp_s + answer.elapsed_s:.0f}s; --rdzv-timeout {plan.timeout_s}); another program may hold "
            f"port {plan.endpoint_port} there: check --rdzv-endpoint, or run `ss -ltnp` on {plan.endpoint_host}.")


def rendezvous_timeout_message(plan: LaunchPlan) -> str:
    nnodes = str(plan.max_nodes) if plan.min_nodes == plan.max_nodes else f"{plan.min_nodes}:{plan.max_nodes}"
    return (f"rendezvous at {plan.endpoint} did not gather --nnodes {nnodes} nodes within "
            f"{plan.rdzv_conf.get('join_timeout', plan.timeout_s)}s on {_host(plan)}: start `meshrun launch` on the "
            f"missing nodes with --nnodes {nnodes} --rdzv-endpoint {plan.endpoint}, or raise --rdzv-timeout.")


def _host(plan: LaunchPlan) -> str:
    return f"{socket.gethostname()} ({plan.local_addr} on {plan.iface or '?'})"


def _user_conf(largs: LaunchArgs) -> str:
    return largs.ns.rdzv_conf if "rdzv_conf" in largs.given else ""


def _exit_code(code: int) -> int:
    """A worker killed by a signal reports -N; a shell reports 128+N."""
    if code < 0:
        return 128 - code if -code in signal.valid_signals() else 1
    return code or 1
