"""``meshrun doctor``: check nodes before training.

Under ``meshrun launch`` / torchrun (one worker per GPU, or ``--nproc-per-node 1``) every worker runs the checks
together and rank 0 prints: code and package versions per node, the N x N TCP reachability matrix with every
failing pair named, the GPUs each node sees, the NCCL/gloo variables in effect, and a small all-reduce (gloo,
and NCCL where every rank has a GPU) checked for the right sum and timed. Then one pass / warn / fail row per
check, each from its own module: socket interfaces (:mod:`.ifname`), clock skew (:mod:`.clock`), GPUs per node
(:mod:`.devices`), per-GPU GEMM and memory speed (:mod:`.gpu_health`), the checkpoint folder and the dataset
(:mod:`.storage`); the report ends with the next command to run for each failure (:mod:`.rows`). Exit code 1 on
any problem, 2 on a bad ``--config``.

As a plain process it prints the local view: interfaces, the route and TCP reachability of ``--endpoint``,
GPUs and versions.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from meshrun.diag import clock, devices, gpu_health, ifname, reach, rows, storage
from meshrun.diag.gather import gather_node_facts
from meshrun.diag.rows import FAIL, CheckRow
from meshrun.diag.fingerprint import (FieldDiff, Fingerprint, collect_fingerprint, compare_fingerprints,
                                      gather_fingerprints, mismatch_message)
from meshrun.env import DEFAULT_MASTER_PORT, ClusterEnv
from meshrun.help_format import PlainHelpFormatter
from meshrun.launch import net
from meshrun.launch.stores import probe_store
from meshrun.units import format_ranks

_ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_FR_", "TORCH_DISTRIBUTED_", "CUDA_VISIBLE_DEVICES",
                 "TORCH_CPP_LOG_LEVEL")


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
    env = ClusterEnv.detect()
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


# ---- facts each rank contributes -------------------------------------------------------------------------------

@dataclass(frozen=True)
class NodeFacts:
    rank: int
    node_rank: int
    local_rank: int
    host: str
    address: str
    address_why: str
    gpus: tuple[str, ...]
    nccl: bool
    env_vars: dict[str, str]


def local_facts(env: ClusterEnv) -> NodeFacts:
    address, why = reach.advertised_address(env)
    gpus = tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) \
        if torch.cuda.is_available() else ()
    return NodeFacts(rank=env.rank, node_rank=env.node_rank, local_rank=env.local_rank, host=socket.gethostname(),
                     address=address, address_why=why, gpus=gpus, nccl=dist.is_nccl_available(),
                     env_vars=comm_env_vars())


def comm_env_vars() -> dict[str, str]:
    """NCCL/gloo/torch.distributed variables in effect (not rank variables: those come from ClusterEnv)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES)}


@dataclass
class CollectiveCheck:
    backend: str
    ok: bool
    seconds: float
    detail: str


@dataclass
class DoctorReport:
    env: ClusterEnv
    facts: list[NodeFacts]
    fingerprints: list[Fingerprint]
    diffs: list[FieldDiff]
    matrix: reach.ReachMatrix
    collectives: list[CollectiveCheck] = field(default_factory=list)
    rows: list[CheckRow] = field(default_factory=list)
    health: list[gpu_health.GpuHealth] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ---- the distributed run ---------------------------------------------------------------------------------------

def run_distributed(env: ClusterEnv, args: argparse.Namespace) -> DoctorReport:
    """All checks; every rank must call this and gets the same report. Starts and ends a gloo group."""
    from meshrun.config import DistConfig
    from meshrun.comm.process_group import init_distributed, shutdown

    started_here = not dist.is_initialized()
    # a GLOO_SOCKET_IFNAME gloo refuses would stop doctor's own group from starting to report it
    refused_gloo = ifname.repair_gloo(os.environ, master_addr=env.master_addr)
    init_distributed(env, DistConfig(backend="gloo", device="cpu", init_timeout_s=args.wait))
    try:
        facts = _gather(local_facts(env))
        fingerprints = gather_fingerprints(env=env, script=args.script)
        matrix = reach.check_reachability(env=env, timeout_s=args.timeout, wait_s=args.wait, tag="doctor")
        report = DoctorReport(env=env, facts=facts, fingerprints=fingerprints,
                              diffs=compare_fingerprints(fingerprints), matrix=matrix)
        report.collectives.append(allreduce_check("gloo", _gloo_group, env=env))
        if all(len(f.gpus) > f.local_rank and f.nccl for f in facts):  # same decision on every rank
            report.collectives.append(allreduce_check("nccl", _nccl_group(env, args.wait), env=env))
        job_checks(report, args, refused_gloo=refused_gloo)
    finally:
        if started_here:
            shutdown()
    judge(report)
    return report


def job_checks(report: DoctorReport, args: argparse.Namespace, *, refused_gloo: str | None) -> None:
    """The check rows: interfaces, clocks, GPUs, GPU speed, checkpoint folder, dataset. Collectives every rank
    must reach in the same order (the decisions below depend only on arguments and gathered facts)."""
    env, host, leader = report.env, socket.gethostname(), report.env.local_rank == 0
    environ = dict(os.environ) | ({ifname.GLOO_VAR: refused_gloo} if refused_gloo else {})
    peers = {f.node_rank: f.address for f in _node_leaders(report.facts)}
    mine = ifname.local_facts(environ, node=env.node_rank, host=host, peers=peers) if leader else None
    report.rows.append(ifname.judge_ifnames(gather_node_facts(mine)))
    offsets = clock.measure_offsets(env)
    report.rows.append(clock.judge_clock({(f.node_rank, f.host): offsets[f.rank] for f in _node_leaders(report.facts)},
                                         max_skew_s=args.max_clock_skew))
    inventory = devices.inventory(env.node_rank, host) if leader else None
    report.rows.append(devices.judge_gpus(gather_node_facts(inventory),
                                          nproc_per_node=args.nproc_per_node or env.local_world_size))
    if not args.no_gpu_health:
        mine_health = gpu_health.measure_local(rank=env.rank, node=env.node_rank, host=host, local_rank=env.local_rank,
                                               local_world_size=env.local_world_size)
        report.health = [h for part in _gather(mine_health) for h in part]
        report.rows.append(gpu_health.judge_health(report.health, threshold=args.gpu_threshold))
    data, folder, needed = getattr(args, "targets", None) or job_targets(args)
    if folder:
        report.rows += storage.check_checkpoint_folder(env, folder, host=host, needed=needed)
    if data:
        report.rows.append(storage.check_dataset(env, data, host=host, deep=args.deep))


def job_targets(args: argparse.Namespace) -> tuple[str | None, str | None, int]:
    """(dataset path, checkpoint folder, bytes of one checkpoint) from --config and the explicit options."""
    from meshrun.diag.bench import parse_size

    data, folder = args.data, args.ckpt_dir
    needed = parse_size(args.ckpt_bytes) if args.ckpt_bytes else 0
    if args.config:
        from meshrun.config import load_config
        from meshrun.models.build import model_config, model_spec

        job = load_config(args.config)
        data = data or (job.data.source if job.data.source != "stdlib" else None)
        folder = folder or job.checkpoint.dir or str(Path(job.run.dir) / "checkpoints")
        from meshrun.ckpt.storage import register_options

        register_options(folder, job.checkpoint.storage_options)
        needed = needed or model_spec(job).count_params(model_config(job)) * storage.BYTES_PER_PARAM
    return data, folder, needed


def _gather(obj):
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)  # note: collective, every rank must reach it
    return gathered


_CHECK_NUMEL = 1 << 20  # 4 MiB of fp32: big enough to cross the eager/rendezvous protocol switch, quick everywhere


def allreduce_check(backend: str, group_and_device: Callable[[], tuple[object, torch.device]], *,
                    env: ClusterEnv) -> CollectiveCheck:
    """Sum (rank + 1) over all ranks, compare with n(n+1)/2, time it; the outcome of every rank on every rank.

    ``group_and_device`` makes the group to test (a collective itself). A failure on some ranks is caught
    there and still reaches the final gather on the default (gloo) group, so no rank is left waiting.
    """
    n = env.world_size
    try:
        wrong, seconds = _sum_ranks(*group_and_device(), env=env)
        error = None
    except Exception as exc:  # noqa: BLE001 - reported as a problem with the cause
        wrong, seconds, error = 0, 0.0, f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
    outcomes: list = [None] * n
    dist.all_gather_object(outcomes, (env.rank, wrong, seconds, error))  # note: collective, default group
    slowest = max(s for _, _, s, _ in outcomes)
    size = f"{_CHECK_NUMEL * 4 / 2**20:.0f} MiB fp32"
    failed = [f"rank {rank}: {err}" for rank, _, _, err in outcomes if err]
    if failed:
        return CollectiveCheck(backend, False, slowest, f"{size}: failed on {len(failed)} rank(s): "
                                                        + "; ".join(failed[:4]))
    bad = [f"rank {rank}: {count} wrong elements" for rank, count, _, _ in outcomes if count]
    if bad:
        return CollectiveCheck(backend, False, slowest,
                               f"{size}: wrong sum ({', '.join(bad)}); expected {n * (n + 1) // 2}")
    return CollectiveCheck(backend, True, slowest, f"{size}: sum correct on all {n} ranks")


def _sum_ranks(group, device: torch.device, *, env: ClusterEnv) -> tuple[int, float]:
    """(wrong elements, seconds) of one timed all-reduce after a warm-up. Collectives every rank must reach."""
    n = env.world_size
    x = torch.full((_CHECK_NUMEL,), float(env.rank + 1), dtype=torch.float32, device=device)  # (numel,)
    dist.all_reduce(x.clone(), group=group)  # warm-up: connection set-up is not what we time
    _sync(device)
    start = time.perf_counter()
    dist.all_reduce(x, group=group)
    _sync(device)  # note: a CPU-GPU sync point, so the time covers the collective
    seconds = time.perf_counter() - start
    return int((x != n * (n + 1) / 2).sum().item()), seconds


def _gloo_group() -> tuple[object, torch.device]:
    return None, torch.device("cpu")


def _nccl_group(env: ClusterEnv, wait_s: float) -> Callable[[], tuple[object, torch.device]]:
    def make() -> tuple[object, torch.device]:
        torch.cuda.set_device(env.local_rank)
        group = dist.new_group(backend="nccl", timeout=timedelta(seconds=wait_s))  # note: collective
        return group, torch.device("cuda", env.local_rank)
    return make


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def judge(report: DoctorReport) -> None:
    """Fill ``problems`` (exit code 1) and ``notes`` from the gathered facts. Pure logic."""
    if report.diffs:
        report.problems.append(mismatch_message(report.diffs, report.fingerprints).splitlines()[0])
    report.problems += report.matrix.failures()
    report.problems += [f"all-reduce ({c.backend}): {c.detail}" for c in report.collectives if not c.ok]
    report.problems += [f"{row.check}: {row.detail}" for row in report.rows if row.status == FAIL]
    nodes = _node_leaders(report.facts)
    if len({f.host for f in nodes}) > 1:  # several nodes on one host (a test) may well talk over loopback
        for fact in nodes:
            if net.is_loopback(fact.address):
                report.problems.append(
                    f"node {fact.node_rank} (host {fact.host}) would be reached at loopback address {fact.address} "
                    f"({fact.address_why}); set MASTER_ADDR to a routable address or NCCL_SOCKET_IFNAME")
    gpu_sets = {f.gpus for f in nodes}
    if len(gpu_sets) > 1:
        report.notes.append("nodes see different GPUs: " + "; ".join(
            f"node {f.node_rank} ({f.host}): {len(f.gpus)} x {', '.join(sorted(set(f.gpus))) or 'none'}"
            for f in nodes))
    for fact in report.facts:
        if fact.gpus and fact.local_rank >= len(fact.gpus):
            report.problems.append(f"rank {fact.rank} (host {fact.host}) is local rank {fact.local_rank} but its "
                                   f"node has {len(fact.gpus)} GPUs; start at most {len(fact.gpus)} per node")


def _node_leaders(facts: list[NodeFacts]) -> list[NodeFacts]:
    leaders: dict[int, NodeFacts] = {}
    for fact in sorted(facts, key=lambda f: f.rank):
        leaders.setdefault(fact.node_rank, fact)
    return [leaders[node] for node in sorted(leaders)]


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
    for leader in _node_leaders(report.facts):
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
    per_node = {f.node_rank: f.env_vars for f in _node_leaders(report.facts)}
    if len({tuple(v.items()) for v in per_node.values()}) <= 1:
        values = next(iter(per_node.values()), {})
        shown = ", ".join(f"{k}={v}" for k, v in values.items()) or "none set"
        console.print(f"communication variables (same on every node): {shown}", markup=False)
        return
    for node, values in per_node.items():
        shown = ", ".join(f"{k}={v}" for k, v in values.items()) or "none set"
        console.print(f"communication variables on node {node}: {shown}", markup=False)


# ---- a single process ------------------------------------------------------------------------------------------

def run_local(args: argparse.Namespace, *, console: Console) -> int:
    """The local view. Exit code 1 when ``--endpoint`` cannot be resolved or does not answer."""
    env = ClusterEnv.detect()
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
    return check_endpoint(args.endpoint, timeout_s=args.timeout, console=console) if args.endpoint else 0


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
