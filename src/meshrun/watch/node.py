"""The trainer's view of system metrics: one sampler per node, gathered at log intervals, judged on rank 0.

Local rank 0 of each node runs the :class:`~meshrun.watch.system.SystemSampler` (and the Prometheus endpoint when
``run.prometheus_port`` is set). At each log interval :meth:`SystemWatch.collect` gathers the node leaders' records
onto rank 0 (one ``gather_object``: a collective every rank reaches), which writes one ``system`` record per node to
metrics.jsonl (with ``node``, ``rank`` and ``host``) and passes them to the tracker and to the verdicts.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from meshrun.config import RunConfig
from meshrun.env import ProcessPlacement
from meshrun.diag.ifname import GLOO_VAR, NCCL_VAR, nccl_matches
from meshrun.launch.net import LOCAL_ADDR_VAR, interface_of
from meshrun.watch.system import SystemSampler, net_bytes
from meshrun.watch.verdicts import SystemVerdicts

log = logging.getLogger("meshrun")


def comm_interface(environ=os.environ, *, gpu: bool, interfaces: list[str] | None = None) -> str | None:
    """The interface NCCL (``gpu``) or gloo sockets use: the first that ``NCCL_SOCKET_IFNAME`` (NCCL's syntax: prefixes,
    ``^`` excludes, ``=`` exact) or ``GLOO_SOCKET_IFNAME`` (names) selects, as ``meshrun launch`` pins them on
    several hosts; else the one owning the address the launcher chose; else None."""
    interfaces = list(net_bytes()) if interfaces is None else interfaces
    nccl, gloo = environ.get(NCCL_VAR, ""), environ.get(GLOO_VAR, "")
    chosen = {NCCL_VAR: nccl_matches(nccl, interfaces) if nccl else [],
              GLOO_VAR: [name for name in gloo.split(",") if name in interfaces]}
    for var in (NCCL_VAR, GLOO_VAR) if gpu else (GLOO_VAR, NCCL_VAR):
        if chosen[var]:
            return chosen[var][0]
    addr = environ.get(LOCAL_ADDR_VAR)
    try:
        return interface_of(addr) if addr else None
    except ValueError:
        return None


def bind_address(run: RunConfig, environ=os.environ) -> str:
    """run.prometheus_addr, else the launcher's address for this node, else loopback (never every interface)."""
    return run.prometheus_addr or environ.get(LOCAL_ADDR_VAR) or "127.0.0.1"


class SystemWatch:
    """System metrics of every node, for the trainer. ``collect`` is a collective: every rank, each log step."""

    def __init__(self, run: RunConfig, *, env: ProcessPlacement, device: torch.device):
        self.env = env
        self.active = run.system_sample_s > 0
        """The same on every rank: collect gathers only when it is on."""
        self.leader = env.local_rank == 0
        self.sampler: SystemSampler | None = None
        self.endpoint = None
        self.verdicts = SystemVerdicts() if env.is_rank_zero else None
        if not self.leader or run.system_sample_s <= 0:
            return
        gpus = list(range(torch.cuda.device_count())) if device.type == "cuda" else []
        self.sampler = SystemSampler(interval_s=run.system_sample_s, gpus=gpus,
                                     comm_iface=comm_interface(gpu=bool(gpus))).start()
        if run.prometheus_port:
            from meshrun.watch.prometheus import MetricsEndpoint

            self.endpoint = MetricsEndpoint(addr=bind_address(run), port=run.prometheus_port, node=env.node_rank)

    @property
    def enabled(self) -> bool:
        return self.sampler is not None

    def collect(self, step: int) -> tuple[list[dict[str, Any]], list[str]]:
        """(records, verdicts) on rank 0, ([], []) elsewhere. Collective when the job spans several nodes: every rank
        calls it."""
        if not self.active:
            return [], []
        mine = None
        if self.sampler is not None:
            mine = {"kind": "system", "step": step, "node": self.env.node_rank, "rank": self.env.rank,
                    "host": socket.gethostname(), **self.sampler.take()}
            if self.endpoint is not None:
                mine["prometheus"] = self.endpoint.url
                self.endpoint.update_system(mine)
        records = [mine] if mine is not None else []
        # on one node rank 0 is its only sampler and already holds the one record: no gather (the same answer on
        # every rank, so all skip it), which saves each log step a pickled gather while the GPUs wait
        if self.env.is_distributed and dist.is_initialized() and self.env.local_world_size < self.env.world_size:
            gathered: list = [None] * dist.get_world_size() if self.env.is_rank_zero else []
            dist.gather_object(mine, gathered if self.env.is_rank_zero else None, dst=0)  # collective: every rank
            records = sorted((g for g in gathered if g is not None), key=lambda r: r["node"])
        if self.verdicts is None:
            return [], []
        return records, [line for record in records for line in self.verdicts.observe(record)]

    def log_interval(self, step: int, train_record: dict[str, Any], sink) -> list[dict[str, Any]]:
        """At a log step: rank 0's endpoint takes the training record; every node's system record goes to
        ``sink`` (metrics.jsonl and the tracker), and a verdict that became due is printed and logged. Returns the
        records (rank 0's node first; [] on other ranks). Collective when on: every rank calls it."""
        if self.endpoint is not None and self.env.is_rank_zero:
            self.endpoint.update_train(train_record)
        records, verdicts = self.collect(step)
        for record in records:
            sink.record(record)
        for verdict in verdicts:
            sink.print(f"warning: {verdict}")
            log.warning("%s", verdict)
        return records

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.stop()
        if self.endpoint is not None:
            self.endpoint.close()
