"""``meshrun doctor``: check nodes before training.

Under ``meshrun launch`` / torchrun (one worker per GPU, or ``--nproc-per-node 1``) every worker runs the checks
together and rank 0 prints: code and package versions per node, the N x N TCP reachability matrix with every
failing pair named, the GPUs each node sees, the NCCL/gloo variables in effect, and a small all-reduce (gloo,
and NCCL where every rank has a GPU) checked for the right sum and timed. Then one pass / warn / fail row per
check, each from its own module: socket interfaces (:mod:`.ifname`), clock skew (:mod:`.clock`), GPUs per node
(:mod:`.devices`), per-GPU GEMM and memory speed (:mod:`.gpu_health`), the checkpoint folder and the dataset
(:mod:`.storage`); the report ends with the next command to run for each failure (:mod:`.rows`). Exit code 1 on
any problem, 2 on a bad ``--config``. This module parses the command line and prints the report; the checks
across ranks and their judgement are :mod:`.doctor_checks`.

As a plain process it prints the local view: interfaces, the route and TCP reachability of ``--endpoint``,
GPUs and versions, and with ``--config``, ``--ckpt-dir`` or ``--data`` the checkpoint folder (write, read back and
delete a probe file or object) and the dataset as this host sees them.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from meshrun.diag import gpu_health, reach, rows, storage
from meshrun.diag.doctor_checks import DoctorReport, comm_env_vars, job_targets, node_leaders, run_distributed
from meshrun.diag.fingerprint import collect_fingerprint, mismatch_message
from meshrun.env import DEFAULT_MASTER_PORT, ProcessPlacement
from meshrun.help_format import PlainHelpFormatter
from meshrun.launch import net
from meshrun.launch.stores import probe_store
from meshrun.units import format_ranks

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshrun doctor", description=__doc__.splitlines()[0],
                                     formatter_class=PlainHelpFormatter)
    parser.add_argument("--endpoint", metavar="HOST:PORT",
                        help="single process: show the route to HOST and whether its TCP PORT (default "
                             f"{DEFAULT_MASTER_PORT}) answers, e.g. the master's rendezvous port")
    parser.add_argument("--timeout", type=float, default=3.0, metavar="S",
                        help="seconds each TCP connection attempt, and --endpoint's store handshake, may take "
                             "(default 3)")
    parser.add_argument("--wait", type=float, default=120.0, metavar="S",
                        help="seconds to wait for all ranks at start-up and for NCCL set-up (default 120)")
    parser.add_argument("--script", metavar="PATH", help="also compare the hash of this entry script across nodes")
    job = parser.add_argument_group("the job's data, checkpoints and GPUs")
    job.add_argument("--config", metavar="TOML", help="the job's config: its data.source, checkpoint folder and "
                                                      "model size (for the checkpoint's size) are checked")
    job.add_argument("--data", metavar="PATH", help="dataset file or folder every node reads (overrides --config)")
    job.add_argument("--deep", action="store_true", help="also compare the dataset's SHA-256 across nodes")
    job.add_argument("--ckpt-dir", metavar="DIR", help="checkpoint folder (overrides --config)")
    job.add_argument("--ckpt-bytes", metavar="SIZE", help="size of one checkpoint, e.g. 40G (default: estimated "
                                                         "from --config's model: 12 bytes per parameter)")
    job.add_argument("--nproc-per-node", type=int, default=0, metavar="N",
                     help="workers per node the job will start (default: this launch's)")
    job.add_argument("--max-clock-skew", type=float, default=0.5, metavar="S",
                     help="warn when a node's clock is further than this from node 0's (default 0.5 s)")
    job.add_argument("--gpu-threshold", type=float, default=0.15, metavar="F",
                     help="name GPUs whose GEMM or memory bandwidth is more than this fraction below the job's "
                          "median (default 0.15)")
    job.add_argument("--no-gpu-health", action="store_true", help="skip the GEMM and memory-bandwidth test")
    parser.add_argument("--json", metavar="FILE", help="also write the check rows, per-GPU figures and problems as "
                                                      "JSON (rank 0)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    env = ProcessPlacement.detect()
    console = Console(highlight=False, soft_wrap=True)
    if not env.is_distributed:
        return run_local(args, console=console)
    from meshrun.config import ConfigError

    try:
        args.targets = job_targets(args)  # before any collective: every rank fails alike on a bad --config
    except (ConfigError, ValueError) as exc:
        console.print(f"meshrun doctor: {exc}", markup=False)
        return 2
    report = run_distributed(env, args)
    if env.is_rank_zero:
        render(report, console)
        if args.json:
            write_json(report, Path(args.json))
    return 1 if report.problems else 0


# ---- printing --------------------------------------------------------------------------------------------------

def render(report: DoctorReport, console: Console) -> None:
    env = report.env
    console.print(f"[bold]meshrun doctor[/]: {env.world_size} ranks on {env.num_nodes} nodes, master "
                  f"{env.master_addr}:{env.master_port} ({env.source})")
    console.print(_nodes_table(report))
    console.print(_matrix_table(report.matrix))
    if report.diffs:
        console.print(mismatch_message(report.diffs, report.fingerprints), markup=False)
    else:
        fp = report.fingerprints[0]
        console.print(f"code and packages agree on all ranks: meshrun {fp.meshrun} source {fp.meshrun_source}, "
                      f"git {fp.git or '-'}, torch {fp.torch_build}, python {fp.python}", markup=False)
    for check in report.collectives:
        mark = "[green]ok[/]" if check.ok else "[red]FAILED[/]"
        console.print(f"all-reduce {check.backend}: {mark} {escape(check.detail)}, "
                      f"slowest rank {check.seconds * 1e3:.1f} ms")
    _print_env_vars(report, console)
    if report.health:
        console.print(_health_table(report.health))
    for line in rows.lines(report.rows):
        console.print(line)
    for note in report.notes:
        console.print(f"[yellow]note[/]: {note}")
    if report.problems:
        console.print(f"[bold red]{len(report.problems)} problem(s):[/]")
        for problem in report.problems:
            console.print(f"  - {problem}", markup=False)
    else:
        console.print("[bold green]no problems found[/]")
    steps = rows.next_steps(report.rows)
    if steps:
        console.print("[bold]what to run next[/] (upstream causes first):")
        for line in steps:
            console.print(f"  {line}", markup=False)


def write_json(report: DoctorReport, path: Path) -> None:
    """The machine-readable report: check rows, per-device figures, all-reduce checks and problems."""
    import json
    from dataclasses import asdict

    path.write_text(json.dumps({"rows": [asdict(r) for r in report.rows], "health": [asdict(h) for h in report.health],
                                "collectives": [asdict(c) for c in report.collectives],
                                "problems": report.problems, "notes": report.notes}, indent=2) + "\n")


def _health_table(health: list[gpu_health.GpuHealth]) -> Table:
    table = Table(title="per-device speed (GEMM: bf16 on GPU, fp32 on CPU; memory: copy, read + write)")
    for column in ("node", "host", "device", "GEMM TFLOP/s", "memory GB/s", "clock / temperature (NVML)"):
        table.add_column(column)
    for h in health:
        table.add_row(str(h.node), h.host, f"{h.device} {h.name}", f"{h.gemm_tflops:.3g}", f"{h.mem_gbps:.4g}",
                      gpu_health.describe_nvml(h.nvml) or "-")
    return table


def _nodes_table(report: DoctorReport) -> Table:
    table = Table(title="nodes")
    for column in ("node", "host", "address (how chosen)", "ranks", "GPUs"):
        table.add_column(column)
    for leader in node_leaders(report.facts):
        ranks = [f.rank for f in report.facts if f.node_rank == leader.node_rank]
        gpus = f"{len(leader.gpus)} x {leader.gpus[0]}" if leader.gpus else "none (CPU)"
        table.add_row(str(leader.node_rank), leader.host, f"{leader.address} ({leader.address_why})",
                      format_ranks(sorted(ranks)), gpus)
    return table


def _matrix_table(matrix: reach.ReachMatrix) -> Table:
    table = Table(title="TCP reachability: row node connects to column node's listener")
    table.add_column("from \\ to")
    for ep in matrix.endpoints:
        table.add_column(f"{ep.node} {ep.host}\n{ep.addr}:{ep.port}")
    for src, row in zip(matrix.endpoints, matrix.rows):
        cells = [f"[green]ok {p.ms:.1f} ms[/]" if p.ok else f"[red]{escape(p.error.split(' (')[0])}[/]" for p in row]
        table.add_row(f"{src.node} {src.host}", *cells)
    return table


def _print_env_vars(report: DoctorReport, console: Console) -> None:
    """The variables as the user set them on each node (not doctor's stand-ins, which follow in brackets)."""
    per_node = {f.node_rank: _describe_env_vars(f.env_vars, f.stand_ins) for f in node_leaders(report.facts)}
    if len(set(per_node.values())) <= 1:
        shown = next(iter(per_node.values()), "none set")
        console.print(f"communication variables (same on every node): {shown}", markup=False)
        return
    for node, shown in per_node.items():
        console.print(f"communication variables on node {node}: {shown}", markup=False)


def _describe_env_vars(env_vars: dict[str, str], stand_ins: dict[str, str]) -> str:
    """'GLOO_SOCKET_IFNAME=eth9, NCCL_DEBUG=INFO (doctor's own group used GLOO_SOCKET_IFNAME=eth0 instead)'."""
    shown = ", ".join(f"{k}={v}" for k, v in env_vars.items()) or "none set"
    used = [f"{k}={v}" if v else f"no {k}" for k, v in stand_ins.items()]
    return shown + (f" (doctor's own group used {', '.join(used)} instead)" if used else "")


# ---- a single process ------------------------------------------------------------------------------------------

def run_local(args: argparse.Namespace, *, console: Console) -> int:
    """The local view. Exit code 1 when ``--endpoint`` cannot be resolved or does not answer, or the checkpoint
    folder or dataset fails its check; 2 on a bad ``--config``."""
    from meshrun.config import ConfigError

    try:  # before anything is printed: a bad --config is the one line shown
        targets = job_targets(args) if (args.config or args.ckpt_dir or args.data) else (None, None, 0)
    except (ConfigError, ValueError) as exc:
        console.print(f"meshrun doctor: {exc}", markup=False)
        return 2
    env = ProcessPlacement.detect()
    fp = collect_fingerprint(env=env, script=args.script)
    console.print(f"[bold]meshrun doctor[/] (single process; run it under `meshrun launch` on every node for the "
                  f"cross-node checks) on host {fp.host}")
    table = Table(title="interfaces")
    for column in ("interface", "addresses"):
        table.add_column(column)
    for name, addrs in net.interface_addresses().items():
        table.add_row(name, ", ".join(addrs) or "-")
    console.print(table)
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    console.print(f"GPUs: {len(gpus)}" + (f" ({', '.join(gpus)})" if gpus else ""))
    console.print(f"versions: meshrun {fp.meshrun} source {fp.meshrun_source}, git {fp.git or '-'}, torch "
                  f"{fp.torch_build}, python {fp.python}, " +
                  ", ".join(f"{k} {v}" for k, v in fp.packages.items() if v and k != "torch"), markup=False)
    shown = ", ".join(f"{k}={v}" for k, v in comm_env_vars().items()) or "none set"
    console.print(f"communication variables: {shown}", markup=False)
    code = check_endpoint(args.endpoint, timeout_s=args.timeout, console=console) if args.endpoint else 0
    return max(code, check_storage_here(*targets, deep=args.deep, host=fp.host, console=console))


def check_storage_here(data: str | None, folder: str | None, needed: int, *, deep: bool, host: str,
                       console: Console) -> int:
    """The checkpoint folder and dataset as this host sees them. 0: passed (or nothing to check); 1: a row failed."""
    found = storage.check_checkpoint_folder_here(folder, host=host, needed=needed) if folder else []
    if data:
        found.append(storage.judge_data(data, [storage.data_facts(data, node=0, host=host, deep=deep)]))
    if not found:
        return 0
    for line in rows.lines(found):
        console.print(line)
    console.print("[dim]checked on this host only; under `meshrun launch ... -m meshrun doctor` every node checks "
                  "them, and doctor names the nodes that do not see the same folder and dataset[/]")
    steps = rows.next_steps(found)
    if steps:
        console.print("[bold]what to run next[/]:")
        for line in steps:
            console.print(f"  {line}", markup=False)
    return 1 if any(row.status == rows.FAIL for row in found) else 0


def check_endpoint(endpoint: str, *, timeout_s: float, console: Console) -> int:
    """Route, TCP reachability and a torch store's answer at HOST:PORT, as `meshrun launch` checks its endpoint
    (launch/stores.probe_store). 0: a store answers; 1: unreachable, or not a store; 2: malformed. A listener that
    accepts and never answers leaves torch's client blocked: the process then ends here with os._exit(1)."""
    try:
        host, port = net.parse_endpoint(endpoint, default_port=DEFAULT_MASTER_PORT)
    except net.EndpointError as exc:
        console.print(f"--endpoint: {exc}", markup=False)
        return 2
    try:
        route = net.route_to(host)
    except net.EndpointError as exc:
        console.print(f"[red]--endpoint {escape(endpoint)}[/]: {escape(str(exc))}")
        return 1
    console.print(f"route to {host} ({route.dest}): interface {route.iface or '?'}, source address {route.source}"
                  + (" (an address of this host)" if route.dest_is_local else ""), markup=False)
    result = reach.probe(route.dest, port, timeout_s=timeout_s)
    where = f"[{route.dest}]:{port}" if ":" in route.dest else f"{route.dest}:{port}"
    if not result.ok:
        console.print(f"[red]cannot reach {escape(host)} ({escape(where)})[/]: {escape(result.error or '')}")
        return 1
    # a port that accepts TCP may still be another program's: ask it what `meshrun launch` asks before joining
    answer = probe_store(route.dest, port, timeout_s=max(timeout_s, 1.0))
    if answer.ok:
        console.print(f"[green]{escape(host)}:{port} answers[/] (TCP connect in {result.ms:.1f} ms; a torch store "
                      f"answered in {answer.elapsed_s * 1e3:.0f} ms)")
        return 0
    console.print(f"[red]{escape(host)} ({escape(where)}) accepts TCP but is not a torch store[/]: "
                  f"{escape(answer.error)}; another program may hold port {port} there: check the endpoint, or run "
                  f"`ss -ltnp` on {escape(host)}")
    if answer.abandoned:  # a store client thread is still blocked in torch; finalizing around it would abort
        console.file.flush()
        os._exit(1)
    return 1
