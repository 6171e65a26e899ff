"""GPUs per node for ``meshrun doctor``: enough visible GPUs for ``--nproc-per-node``, and the same GPU model,
driver and CUDA on every node.

The driver version comes from NVML (``nvidia-ml-py``) when it is importable, else from
``/proc/driver/nvidia/version``; the CUDA version is the one torch was built with. Pure logic apart from
:func:`inventory`.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from meshrun.diag.rows import FAIL, PASS, WARN, CheckRow, node_label


@dataclass(frozen=True)
class GpuInventory:
    node: int
    host: str
    names: tuple[str, ...]
    """The model of each visible GPU (CUDA_VISIBLE_DEVICES applies)."""
    driver: str | None
    cuda: str | None


def inventory(node: int, host: str) -> GpuInventory:
    names = tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) \
        if torch.cuda.is_available() else ()
    return GpuInventory(node=node, host=host, names=names, driver=driver_version() if names else None,
                        cuda=torch.version.cuda if names else None)


def driver_version() -> str | None:
    try:
        import pynvml  # nvidia-ml-py, optional

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # noqa: BLE001 - not installed, or no driver: fall back to the kernel module's file
        pass
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return None
    match = re.search(r"Kernel Module\s+(?:for \S+\s+)?([\d.]+)", text)
    return match.group(1) if match else None


def judge_gpus(nodes: list[GpuInventory], *, nproc_per_node: int) -> CheckRow:
    """One row. Fail: a GPU node with fewer GPUs than ``nproc_per_node`` workers, or a mix of GPU and CPU-only
    nodes. Warn: different GPU models, drivers or CUDA versions; idle GPUs. Pass otherwise."""
    if not any(n.names for n in nodes):
        return CheckRow("GPUs per node", PASS, f"no GPUs on any of {len(nodes)} node(s): a CPU job (gloo)")
    short = [n for n in nodes if len(n.names) < nproc_per_node]
    if short:
        hosts = tuple(n.host for n in short)
        seen = "; ".join(f"{node_label(n.node, n.host)} sees {len(n.names)}" for n in short)
        return CheckRow("GPUs per node", FAIL, f"--nproc-per-node {nproc_per_node} needs {nproc_per_node} GPUs on "
                                               f"every node: {seen}",
                        fix=f"start {min(len(n.names) for n in nodes)} workers per node, or fix CUDA_VISIBLE_DEVICES "
                            "/ the job's GPU request on those nodes",
                        next_command=f"nvidia-smi -L and `echo $CUDA_VISIBLE_DEVICES` on {', '.join(hosts)}",
                        hosts=hosts)
    differ = [what for what, values in (("GPU model", [n.names for n in nodes]), ("driver", [n.driver for n in nodes]),
                                        ("CUDA", [n.cuda for n in nodes])) if len(set(values)) > 1]
    if differ:
        return _mixed_row(nodes, differ)
    first = nodes[0]
    idle = [n for n in nodes if len(n.names) > nproc_per_node]
    text = (f"{len(first.names)} x {first.names[0]} on each of {len(nodes)} node(s), driver {first.driver or '?'}, "
            f"CUDA {first.cuda or '?'}")
    if idle:
        return CheckRow("GPUs per node", WARN, f"{text}; only {nproc_per_node} used per node",
                        fix=f"--nproc-per-node {len(first.names)} uses them all")
    return CheckRow("GPUs per node", PASS, text)


def _mixed_row(nodes: list[GpuInventory], differ: list[str]) -> CheckRow:
    common = Counter((n.names, n.driver, n.cuda) for n in nodes).most_common(1)[0][0]
    odd = [n for n in nodes if (n.names, n.driver, n.cuda) != common]
    describe = lambda n: (f"{node_label(n.node, n.host)}: {len(n.names)} x "  # noqa: E731 - one format
                          f"{', '.join(sorted(set(n.names))) or 'none'}, driver {n.driver or '-'}, CUDA {n.cuda or '-'}")
    mixed_cpu = any(not n.names for n in nodes)
    return CheckRow("GPUs per node", FAIL if mixed_cpu else WARN,
                    f"{' and '.join(differ)} differ: " + "; ".join(describe(n) for n in odd) + "; the others: "
                    + describe(next(n for n in nodes if (n.names, n.driver, n.cuda) == common)).split(": ", 1)[1],
                    fix="run the job on nodes of one kind (a mixed job runs at the slowest GPU's pace; NCCL may "
                        "refuse a CPU-only node)", next_command="nvidia-smi on " + ", ".join(n.host for n in odd),
                    hosts=tuple(n.host for n in odd))
