"""Replica groups on two hosts: the lighthouse and group 0 on host0 (10.77.0.1), group 1 on host1 (10.77.0.2), two
network namespaces joined by a veth pair (tests/netns.py). Inside them the host name resolves to 127.0.0.1, so this
shows that every address one group gives the others (its manager, its store, its gloo sockets, the server a healing
group fetches the live state from) is the host's own address on the route to the lighthouse, not loopback.

Group 1 is SIGKILLed mid-all-reduce, group 0 goes on alone (at most that step discarded, a stall of at most the
heartbeat timeout + 2 s), group 1 started again heals across the link, and both groups' weights are bitwise equal
from the first step both ran to the end (the checks of tests/test_replica_groups.py's kill_restart_heal).
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchft", reason="torchft is not installed (pip install 'meshrun[ft]')")

from test_replica_groups import job, kill_restart_heal  # noqa: E402,F401 - after the skip; job is a fixture

pytestmark = [pytest.mark.netns, pytest.mark.slow]
pytest_plugins = ["netns"]  # the two_hosts fixture (tests/netns.py)


def test_groups_on_two_hosts_survive_a_kill_mid_allreduce_and_heal_across_the_link(job, tmp_path, two_hosts):
    kill_restart_heal(job, tmp_path, nproc=1, hosts=two_hosts)
