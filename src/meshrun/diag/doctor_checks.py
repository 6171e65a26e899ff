"""The checks of ``meshrun doctor`` across the ranks of a launch: the facts each rank contributes, the distributed
run that gathers them (fingerprints, reachability, all-reduces, the job's data, checkpoint folder and GPUs) and the
judgement that turns them into problems. Pure data and collectives; :mod:`meshrun.diag.doctor` parses the command
line and prints the report.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Callable, Mapping

import torch
import torch.distributed as dist

from meshrun.diag import clock, devices, gpu_health, ifname, reach, storage
from meshrun.diag.gather import gather_node_facts
from meshrun.diag.rows import FAIL, CheckRow
from meshrun.diag.fingerprint import (FieldDiff, Fingerprint, compare_fingerprints, gather_fingerprints,
                                      mismatch_message)
from meshrun.env import ProcessPlacement
from meshrun.launch import net

_ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_FR_", "TORCH_DISTRIBUTED_", "CUDA_VISIBLE_DEVICES",
                 "TORCH_CPP_LOG_LEVEL")


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
    """The communication variables as the user set them (:func:`comm_env_vars`)."""
    stand_ins: dict[str, str] = field(default_factory=dict)
    """What doctor's own group used instead of a value it had to replace ('' for unset): {variable: value}."""


def local_facts(env: ProcessPlacement, *, refused_gloo: str | None = None) -> NodeFacts:
    """This rank's facts; ``refused_gloo``: the user's GLOO_SOCKET_IFNAME that doctor replaced in os.environ
    (:func:`meshrun.diag.ifname.repair_gloo`), reported as set, with the stand-in beside it."""
    address, why = reach.advertised_address(env)
    stand_ins: dict[str, str] = {}
    if refused_gloo:
        stand_ins[ifname.GLOO_VAR] = os.environ.get(ifname.GLOO_VAR, "")
        if why.startswith(f"{ifname.GLOO_VAR}="):  # the stand-in chose the address, not the user's value
            why += f", doctor's stand-in for {refused_gloo}"
    gpus = tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) \
        if torch.cuda.is_available() else ()
    return NodeFacts(rank=env.rank, node_rank=env.node_rank, local_rank=env.local_rank, host=socket.gethostname(),
                     address=address, address_why=why, gpus=gpus, nccl=dist.is_nccl_available(),
                     env_vars=comm_env_vars(user_environ(refused_gloo)), stand_ins=stand_ins)


def comm_env_vars(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """NCCL/gloo/torch.distributed variables of ``environ`` (default: os.environ); not rank variables: those come
    from ProcessPlacement."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in sorted(environ.items()) if k.startswith(_ENV_PREFIXES)}


def user_environ(refused_gloo: str | None) -> dict[str, str]:
    """os.environ as the user set it: with the GLOO_SOCKET_IFNAME that doctor replaced for its own group put back."""
    return dict(os.environ) | ({ifname.GLOO_VAR: refused_gloo} if refused_gloo else {})


@dataclass
class CollectiveCheck:
    backend: str
    ok: bool
    seconds: float
    detail: str


@dataclass
class DoctorReport:
    env: ProcessPlacement
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

def run_distributed(env: ProcessPlacement, args: argparse.Namespace) -> DoctorReport:
    """All checks; every rank must call this and gets the same report. Starts and ends a gloo group."""
    from meshrun.config import DistConfig
    from meshrun.comm.process_group import init_distributed, shutdown

    started_here = not dist.is_initialized()
    # a GLOO_SOCKET_IFNAME gloo refuses would stop doctor's own group from starting to report it
    refused_gloo = ifname.repair_gloo(os.environ, master_addr=env.master_addr)
    init_distributed(env, DistConfig(backend="gloo", device="cpu", init_timeout_s=args.wait))
    try:
        facts = _gather(local_facts(env, refused_gloo=refused_gloo))
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
    environ = user_environ(refused_gloo)
    peers = {f.node_rank: f.address for f in node_leaders(report.facts)}
    mine = ifname.local_facts(environ, node=env.node_rank, host=host, peers=peers) if leader else None
    report.rows.append(ifname.judge_ifnames(gather_node_facts(mine)))
    offsets = clock.measure_offsets(env)
    report.rows.append(clock.judge_clock({(f.node_rank, f.host): offsets[f.rank] for f in node_leaders(report.facts)},
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
    needed = parse_size(args.ckpt_bytes, "--ckpt-bytes") if args.ckpt_bytes else 0
    if args.config:
        from meshrun.config import load_config
        from meshrun.models.build import model_shape, model_spec

        job = load_config(args.config)
        data = data or (job.data.source if job.data.source != "stdlib" else None)
        folder = folder or job.checkpoint.dir or str(Path(job.run.dir) / "checkpoints")
        from meshrun.ckpt.storage import register_options

        register_options(folder, job.checkpoint.storage_options)
        needed = needed or model_spec(job).count_params(model_shape(job)) * storage.BYTES_PER_PARAM
    return data, folder, needed


def _gather(obj):
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)  # note: collective, every rank must reach it
    return gathered


_CHECK_NUMEL = 1 << 20  # 4 MiB of fp32: big enough to cross the eager/rendezvous protocol switch, quick everywhere


def allreduce_check(backend: str, group_and_device: Callable[[], tuple[object, torch.device]], *,
                    env: ProcessPlacement) -> CollectiveCheck:
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


def _sum_ranks(group, device: torch.device, *, env: ProcessPlacement) -> tuple[int, float]:
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


def _nccl_group(env: ProcessPlacement, wait_s: float) -> Callable[[], tuple[object, torch.device]]:
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
    nodes = node_leaders(report.facts)
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


def node_leaders(facts: list[NodeFacts]) -> list[NodeFacts]:
    leaders: dict[int, NodeFacts] = {}
    for fact in sorted(facts, key=lambda f: f.rank):
        leaders.setdefault(fact.node_rank, fact)
    return [leaders[node] for node in sorted(leaders)]
