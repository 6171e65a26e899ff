"""The node hosting the rendezvous store shuts down last, so the other nodes' shutdowns still reach the store."""

import threading
import time

import torch.distributed as dist

from meshrun.launch import exit_barrier
from meshrun.launch.stores import ShutdownBarrier


class Handler:
    """The two methods of torch's rendezvous handler the barrier wraps; records when shutdown finished."""

    def __init__(self, log, name):
        self.log, self.name = log, name

    def next_rendezvous(self):
        return type("Info", (), {"world_size": 2})()

    def shutdown(self):
        self.log.append(f"{self.name} shut down")
        return True


def test_the_host_returns_only_after_every_node_of_the_round_has_shut_down():
    store, log = dist.HashStore(), []
    host, other = Handler(log, "host"), Handler(log, "other")
    ShutdownBarrier(host, store, key="k", hosting=True)
    ShutdownBarrier(other, store, key="k", hosting=False)
    host.next_rendezvous(), other.next_rendezvous()
    leaving = threading.Thread(target=lambda: (host.shutdown(), log.append("host left")))
    leaving.start()
    time.sleep(0.3)
    assert log == ["host shut down"]  # still waiting for the other node
    assert other.shutdown() is True  # the wrapped shutdown returns what torch's returned
    leaving.join(5)
    assert log == ["host shut down", "other shut down", "host left"]


def test_a_node_that_never_shuts_down_holds_the_host_only_until_the_timeout():
    host = Handler([], "host")
    ShutdownBarrier(host, dist.HashStore(), key="k", hosting=True, timeout_s=0.3)
    host.next_rendezvous()
    started = time.monotonic()
    host.shutdown()
    assert 0.3 <= time.monotonic() - started < 3


def test_a_node_whose_launcher_the_exit_barrier_found_dead_is_not_waited_for(monkeypatch):
    """The exit barrier gave up on a launcher whose heartbeats stopped: that launcher never shuts the rendezvous
    down either, so the host leaves as soon as the live nodes have."""
    monkeypatch.setattr(exit_barrier, "STATE", exit_barrier.BarrierState(entered=True, dead_nodes=1))
    host = Handler([], "host")
    ShutdownBarrier(host, dist.HashStore(), key="k", hosting=True, timeout_s=30)
    host.next_rendezvous()  # 2 nodes: this one, and the dead one
    started = time.monotonic()
    host.shutdown()
    assert time.monotonic() - started < 3
