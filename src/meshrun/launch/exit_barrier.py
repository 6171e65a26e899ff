"""The end of a job on one node: torch's exit barrier, made to say what it waits for and to stop waiting for the dead.

Once its workers succeed, torch's elastic agent waits in ``SimpleElasticAgent._exit_barrier`` until the agent of
every node has got there too: a node that finishes first keeps serving the store to the others. torch waits
silently, up to ``exit_barrier_timeout`` (300 s), which neither ``elastic_launch`` nor ``LaunchConfig`` lets a
caller choose. When another node's launcher was killed (``kill -9``, the OOM killer) while its workers kept running
to the end, nothing ever counts that node in, and this node sat silent for five minutes after a finished job.

:class:`ExitBarrierAgent` is torch's ``LocalElasticAgent`` with that barrier polled instead of blocked on. It uses
torch's own keys (``_barrier_nonblocking``), so it meets agents of plain torchrun as well, and

- after :data:`NOTICE_AFTER_S` says in one line how many nodes it waits for, and for how long at most;
- stops early when every missing node's launcher stopped heart-beating to the c10d rendezvous (such a launcher
  never counts in);
- ends a timeout, or a store that went away, with one line instead of torch's traceback;
- re-raises torch's SignalException (Ctrl-C or SIGTERM while waiting), as torch's barrier does.

torch's ``launch_agent`` builds its agent by the module-global name ``LocalElasticAgent``;
:func:`exit_barrier_agent` points that name at this class while one launch runs.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from torch.distributed.elastic.agent.server import api as agent_api
from torch.distributed.elastic.agent.server.api import WorkerGroup
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException

try:  # private pieces of torch's barrier (torch 2.8 to 2.13 have them); without them torch's own barrier runs
    from torch.distributed.elastic.utils.store import _NUM_MEMBERS, _barrier_nonblocking
except ImportError:
    _NUM_MEMBERS, _barrier_nonblocking = "", None  # type: ignore[assignment]  # None: "not in this torch"

DEFAULT_TIMEOUT_S = 300.0
"""torch's own ``exit_barrier_timeout``."""
NOTICE_AFTER_S = 5.0
"""How long the barrier waits before it says what it waits for (nodes that finish together never see the line)."""
POLL_S = 0.5
"""How often the barrier asks the store whether every node counted in. One cheap store call per node each time."""
NAMED_UP_TO = 64
"""Up to this many nodes, the lines name the missing ones (one store call per node, once)."""

@dataclass
class BarrierState:
    """What this launch's exit barrier went through, for the launcher's last line and the store host's wait."""

    entered: bool = False
    """This node's workers succeeded and its agent reached the exit barrier (a signal now stops no work)."""
    dead_nodes: int = 0
    """Nodes whose launchers the barrier found dead: they never close the rendezvous either (launch/stores.py)."""


STATE = BarrierState()
"""This process's launch (one per launcher process): reset as :func:`exit_barrier_agent` starts one, and read after
it ended (the launcher's last line comes after torch's agent returned)."""

BARRIER_KEY: str = getattr(agent_api, "_TERMINAL_STATE_SYNC_ID", "torchelastic/agent/terminal_state")
"""torch's key prefix for the exit barrier (in the store of the rendezvous round, so one barrier per round)."""


def arrived_key(group_rank: int) -> str:
    """Set by meshrun's agent of node ``group_rank`` as it counts itself in: torch's counter says how many nodes
    arrived, not which, and a launcher that died after counting in must not be taken for one that never did."""
    return f"{BARRIER_KEY}/meshrun_arrived/{group_rank}"


class ExitBarrierAgent(LocalElasticAgent):
    """torch's LocalElasticAgent whose exit barrier waits ``barrier_timeout_s``, talks, and knows dead launchers."""

    def __init__(self, *args, barrier_timeout_s: float | None = None, **kwargs):
        super().__init__(*args, **kwargs)  # torch's keyword arguments differ between versions: all passed on
        if barrier_timeout_s is not None:
            self._exit_barrier_timeout = barrier_timeout_s  # torch's attribute, which its own log lines read
        self._round_nodes: dict[int, object] = {}
        """Group rank -> the c10d rendezvous's descriptor of that node (address, launcher pid), of the last round;
        {} for the static rendezvous."""

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        super()._rendezvous(worker_group)
        self._round_nodes = round_nodes(worker_group.spec.rdzv_handler)

    def _exit_barrier(self) -> None:
        """Count this node in, then wait until every node's agent has (or the timeout, or the missing launchers are
        known dead). Blocks; signals still stop it within POLL_S. Never raises but torch's SignalException."""
        if _barrier_nonblocking is None:  # a torch without the pieces: its own (silent) barrier, with the timeout
            return super()._exit_barrier()
        self._in_exit_barrier = True  # newer torch's health check reads it; older torch has no such attribute
        STATE.entered = True
        started = time.monotonic()
        try:
            self._wait_for_nodes(started)
        except SignalException:
            raise  # Ctrl-C or SIGTERM while waiting: torch's agent stops its workers and the launcher exits
        except Exception as exc:  # noqa: BLE001 - the store is gone (its host's launcher ended): nothing to wait for
            text = str(exc).strip()
            first = text.splitlines()[0][:300] if text else ""
            _say(f"stopped waiting for the other nodes' launchers after {time.monotonic() - started:.0f}s: the "
                 f"store no longer answers ({type(exc).__name__}{': ' + first if first else ''}); this node's "
                 "workers finished, and the job's result on this node stands.")
        finally:
            self._in_exit_barrier = False

    def _wait_for_nodes(self, started: float) -> None:
        store, group = self._store, self._worker_group
        nodes, timeout_s = group.group_world_size, self._exit_barrier_timeout
        store.set(arrived_key(group.group_rank), "1")  # before counting in: whoever sees the count sees the key
        done_key = _barrier_nonblocking(store=store, world_size=nodes, key_prefix=BARRIER_KEY)
        next_look, noticed = started, False
        while not store.check([done_key]):
            now = time.monotonic()
            if now - started >= timeout_s:
                if timeout_s > 0:
                    _say(f"stopped waiting after --exit-barrier-timeout {timeout_s:g} s for the launchers of "
                         f"{self._missing_text()}; this node's workers finished, and the job's result on this node "
                         "stands.")
                return
            if not noticed and now - started >= NOTICE_AFTER_S:
                noticed = True
                _say(f"this node's workers finished; waiting up to {timeout_s:g} s (--exit-barrier-timeout) for the "
                     f"launchers of {self._missing_text()}")
            if now >= next_look:  # heartbeats change once per keep-alive interval: no need to read them each poll
                dead, interval_s = self._dead_missing_nodes()
                if dead:
                    STATE.dead_nodes = len(dead)
                    _say(f"stopped waiting after {now - started:.0f}s: the launcher on {_join(dead)} stopped "
                         "heart-beating to the rendezvous before it finished (killed, or its host went down); "
                         "this node's workers finished, and the job's result on this node stands.")
                    return
                next_look = now + interval_s
            time.sleep(max(0.0, min(POLL_S, started + timeout_s - now)))

    def _dead_missing_nodes(self) -> tuple[list[str], float]:
        """The nodes that never counted in, described, when each of them is known dead, else []; and how long until
        looking again. Known dead: its launcher's heartbeats expired in the c10d rendezvous, so that torch's state
        dropped it. The static rendezvous keeps no heartbeats: [] always (plain waiting)."""
        handler = self._worker_group.spec.rdzv_handler
        alive, interval_s = heartbeating_nodes(handler)
        if alive is None or not self._round_nodes:
            return [], interval_s
        store, nodes = self._store, self._worker_group.group_world_size
        missing = nodes - store.add(BARRIER_KEY + _NUM_MEMBERS, 0)
        silent = [rank for rank, node in sorted(self._round_nodes.items()) if node not in alive]
        gone = [rank for rank in silent if not store.check([arrived_key(rank)])]
        if missing <= 0 or len(gone) < missing:
            return [], interval_s
        return [_describe(rank, self._round_nodes.get(rank)) for rank in gone], interval_s

    def _missing_text(self) -> str:
        """'1 other node(s) to finish: 10.0.0.2 (group rank 1, launcher pid 4242)'; names where they can be told."""
        store, nodes = self._store, self._worker_group.group_world_size
        missing = nodes - store.add(BARRIER_KEY + _NUM_MEMBERS, 0)
        text = f"{missing} other node(s) to finish"
        if nodes > NAMED_UP_TO:
            return text
        absent = [rank for rank in range(nodes) if not store.check([arrived_key(rank)])]
        if len(absent) != missing:  # some nodes run an agent that sets no meshrun key (plain torchrun)
            return text
        return f"{text}: {_join([_describe(rank, self._round_nodes.get(rank)) for rank in absent])}"


def round_nodes(handler: object) -> dict[int, object]:
    """Group rank -> node descriptor of the round the c10d handler just completed; {} for other handlers.

    Private torch state (``DynamicRendezvousHandler._state_holder.state.participants``), read once per round:
    right after the round completes every node is listed, with its address and launcher pid."""
    try:
        participants = handler._state_holder.state.participants  # type: ignore[attr-defined]  # private, guarded
        return {int(rank): node for node, rank in participants.items()}
    except Exception:  # noqa: BLE001 - another handler, or another torch: plain waiting
        return {}


def heartbeating_nodes(handler: object) -> tuple[set[object] | None, float]:
    """The nodes whose launchers still heart-beat to the c10d rendezvous, and its keep-alive interval in seconds.

    ``sync()`` reads torch's rendezvous state from the store and drops every node whose last heartbeat is older
    than keep_alive_interval x keep_alive_max_attempt (5 s x 3 by default), so the nodes left are the live ones.
    Private torch state, all guarded: (None, 1.0) where it is not there (the static rendezvous, another torch).
    The handler's own heartbeat thread syncs the same state; its lock keeps the two apart."""
    try:
        holder, settings = handler._state_holder, handler._settings  # type: ignore[attr-defined]  # private
        interval_s = max(1.0, settings.keep_alive_interval.total_seconds())
        with getattr(handler, "_heartbeat_lock", None) or contextlib.nullcontext():
            holder.sync()
            return set(holder.state.last_heartbeats), interval_s
    except SignalException:
        raise
    except Exception:  # noqa: BLE001 - another handler, or another torch: plain waiting
        return None, 1.0


@contextlib.contextmanager
def exit_barrier_agent(timeout_s: float) -> Iterator[None]:
    """While the block runs, torch's ``launch_agent`` builds :class:`ExitBarrierAgent` waiting ``timeout_s`` at
    most in its exit barrier (torch's name restored afterwards)."""
    from torch.distributed.launcher import api

    torch_agent = api.LocalElasticAgent
    STATE.entered, STATE.dead_nodes = False, 0
    api.LocalElasticAgent = functools.partial(ExitBarrierAgent, barrier_timeout_s=timeout_s)
    try:
        yield
    finally:
        api.LocalElasticAgent = torch_agent


def _describe(rank: int, node: object | None) -> str:
    if node is None:
        return f"group rank {rank}"
    return f"{getattr(node, 'addr', node)} (group rank {rank}, launcher pid {getattr(node, 'pid', '?')})"


def _join(parts: list[str]) -> str:
    return "; ".join(parts)


def _say(line: str) -> None:
    print(f"meshrun launch: {line}", file=sys.stderr, flush=True)
