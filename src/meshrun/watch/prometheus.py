"""A Prometheus endpoint per node (``run.prometheus_port``; needs ``prometheus-client``).

Each node's local rank 0 serves its node's system metrics (and rank 0 the training metrics too) at
``http://ADDR:PORT/metrics``. ADDR is ``run.prometheus_addr`` when set, else the address ``meshrun launch`` chose
for this node (the one its peers reach it at), else loopback: never every interface unless asked for with
``run.prometheus_addr=0.0.0.0``. When PORT is taken (two simulated nodes on one host, another job) the next free
port above it is used; the record of each node says which.
"""

from __future__ import annotations

import errno
import importlib.util
from typing import Any

from meshrun.config import ConfigError

PORT_TRIES = 64
"""Ports tried from run.prometheus_port upwards."""
MISSING = "run.prometheus_port needs prometheus-client: pip install 'meshrun[prometheus]' (or set run.prometheus_port=0)"


def check_installed() -> None:
    """ConfigError when prometheus-client is not installed: asked at start-up (train/plan.py), before anything is
    written into run.dir."""
    if importlib.util.find_spec("prometheus_client") is None:
        raise ConfigError(MISSING)


class MetricsEndpoint:
    """The gauges of one node, served over HTTP by prometheus-client's own server thread."""

    def __init__(self, *, addr: str, port: int, node: int):
        try:
            from prometheus_client import CollectorRegistry, Gauge, start_http_server
        except ImportError as exc:
            raise ConfigError(MISSING) from exc
        self.node = str(node)
        self.registry = CollectorRegistry()
        gauge = lambda name, doc, labels=(): Gauge(name, doc, ["node", *labels], registry=self.registry)  # noqa: E731
        self.gpu = {"util_pct": gauge("meshrun_gpu_utilization_percent", "GPU busy time (NVML)", ["gpu"]),
                    "mem_used_gib": gauge("meshrun_gpu_memory_used_gib", "GPU memory used (NVML)", ["gpu"]),
                    "power_w": gauge("meshrun_gpu_power_watts", "GPU power draw (NVML)", ["gpu"]),
                    "sm_clock_mhz": gauge("meshrun_gpu_sm_clock_mhz", "GPU SM clock (NVML)", ["gpu"])}
        self.host = {"cpu_util_pct": gauge("meshrun_cpu_utilization_percent", "host CPU busy time"),
                     "host_mem_used_gib": gauge("meshrun_host_memory_used_gib", "host memory used")}
        self.net = {"sent_mb_s": gauge("meshrun_network_sent_mb_per_second", "bytes sent", ["iface", "comm"]),
                    "recv_mb_s": gauge("meshrun_network_received_mb_per_second", "bytes received",
                                       ["iface", "comm"])}
        self.train = {"loss": gauge("meshrun_train_loss", "training loss of the last log interval"),
                      "tokens_per_s": gauge("meshrun_train_tokens_per_second", "tokens/s over all ranks"),
                      "step": gauge("meshrun_train_step", "optimizer steps done")}
        self.server, self.thread, self.port = _serve(start_http_server, self.registry, addr=addr, first=port)
        self.addr = addr

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def update_system(self, record: dict[str, Any]) -> None:
        """Set the gauges from this node's ``system`` record (fields it lacks are left unset)."""
        for key, gauge in self.host.items():
            if key in record:
                gauge.labels(self.node).set(record[key])
        for gpu in record.get("gpus", []):
            for key, gauge in self.gpu.items():
                if isinstance(gpu.get(key), (int, float)):
                    gauge.labels(self.node, str(gpu["index"])).set(gpu[key])
        for name, row in record.get("net", {}).items():
            for key, gauge in self.net.items():
                gauge.labels(self.node, name, str(row.get("comm", False)).lower()).set(row[key])

    def update_train(self, record: dict[str, Any]) -> None:
        for key, gauge in self.train.items():
            if isinstance(record.get(key), (int, float)):
                gauge.labels(self.node).set(record[key])

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def _serve(start_http_server, registry, *, addr: str, first: int):
    """Start the server on the first free port from ``first``; raise ConfigError naming the option when none is."""
    for port in range(first, first + PORT_TRIES):
        try:
            server, thread = start_http_server(port, addr=addr, registry=registry)
            return server, thread, port
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise ConfigError(f"run.prometheus_addr={addr}: cannot serve metrics there ({exc.strerror}); give "
                                  "an address of this host, or leave it empty for the one meshrun launch chose")
    raise ConfigError(f"run.prometheus_port={first}: ports {first}..{first + PORT_TRIES - 1} on {addr} are all in "
                      "use; choose another run.prometheus_port")
