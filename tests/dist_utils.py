"""Run a function on N gloo ranks on this machine and collect what each rank returns.

Used by every multi-process CPU test:

    def work(rank, world_size, x):
        ...  # torch.distributed is initialised (gloo), MASTER_ADDR/PORT, RANK, WORLD_SIZE... are set
        return something_picklable

    results = run_distributed(work, 2, x)   # [rank0_result, rank1_result]

A rank that raises fails the call with that rank's traceback; a rank that hangs fails it after ``timeout``.
Several tests' runs can share one spawn through :func:`each_run` and :func:`results_of`.

``threads=1`` runs each rank on one torch thread, as ``meshrun launch`` sets OMP_NUM_THREADS=1 for workers sharing a
host: with a thread per core in every rank, 4 TP ranks on 2 cores trained several times slower (each collective
waited on a rank whose threads were not running). Left at torch's default (a thread per core) where a test compares
the ranks' bf16 results with the test process's own: the CPU's bf16 matmuls round differently with another thread
count.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from meshrun.comm.process_group import shutdown
from meshrun.launch.net import free_port  # noqa: F401 - tests import it from here


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue, init_pg: bool,
           threads: int | None) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0"})
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        if init_pg:
            dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
        # Plain pickle bytes: torch's queue pickler would pass tensors as shared-memory handles, which die with
        # this process before the parent reads them.
        queue.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # noqa: BLE001 - the parent re-raises it with the rank named
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if init_pg:
            shutdown()  # meshrun's: avoids gloo's exit deadlock when a DDP model outlives the group


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 300.0,
                    init_pg: bool = True, threads: int | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; return results by rank. ``threads``:
    torch threads per rank (None: torch's default, one per core)."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue, init_pg, threads), daemon=True)
             for r in range(world_size)]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < world_size:
        if time.monotonic() > deadline:
            break
        if queue.empty():
            if any(p.exitcode not in (None, 0) for p in procs) and queue.empty():
                time.sleep(0.5)
                if queue.empty():
                    break
            time.sleep(0.05)
            continue
        rank, ok, value = queue.get()
        if ok:
            results[rank] = pickle.loads(value)
        else:
            errors.append(f"rank {rank} failed:\n{value}")
            # The test fails either way: give the other ranks a moment to report theirs (a rank blocked in a
            # collective with the failed one would otherwise hold the test until ``timeout``).
            deadline = min(deadline, time.monotonic() + 15)
    for proc in procs:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    missing = [r for r in range(world_size) if r not in results]
    if missing:
        codes = {r: procs[r].exitcode for r in missing}
        raise AssertionError(f"ranks {missing} returned nothing within {timeout:.0f}s (exit codes {codes})")
    return [results[r] for r in range(world_size)]


class Raised(str):
    """The traceback of a run that raised, in place of its result (see :func:`each_run`)."""


def each_run(runs: dict[Any, Callable[[], Any]]) -> dict[Any, Any]:
    """Call each of ``runs`` in turn on this rank: {name: result}, or a :class:`Raised` traceback for a run that
    raised, so that the later runs still report theirs.

    For several tests' runs in one spawn (starting the ranks costs more than many a run); each test reads its own
    run with :func:`results_of`, which fails it alone when that run raised."""
    out = {}
    for name, run in runs.items():
        try:
            out[name] = run()
        except Exception:  # noqa: BLE001 - re-raised by results_of in the test that reads this run
            out[name] = Raised(traceback.format_exc())
    return out


def results_of(per_rank: list[dict], name: Any) -> list[Any]:
    """Every rank's result of the run ``name`` of :func:`each_run`; fails the test with the traceback of a rank whose
    run raised."""
    import pytest

    for rank, results in enumerate(per_rank):
        if isinstance(results[name], Raised):
            pytest.fail(f"{name}: rank {rank} raised:\n{results[name]}", pytrace=False)
    return [results[name] for results in per_rank]


def mesh_group_timeouts(parallel: dict, timeout_s: float) -> tuple[int, int, set[timedelta]]:
    """Build the mesh of ``parallel`` on this gloo world and give its groups ``timeout_s`` (collective).

    Returns (process groups this rank joined while the mesh was built, groups set_mesh_timeouts changed, the
    distinct timeouts of every mesh group afterwards)."""
    import torch

    from meshrun.comm.mesh import ParallelDims
    from meshrun.comm.process_group import set_mesh_timeouts
    from meshrun.config import ParallelConfig

    world = dist.get_world_size()
    dims = ParallelDims.from_config(ParallelConfig(**parallel), world_size=world, gpus_per_node=world)
    before = len(dist.distributed_c10d._world.pg_map)
    dims.build_mesh("cpu")
    made = len(dist.distributed_c10d._world.pg_map) - before
    count = set_mesh_timeouts(dims.all_meshes(), timeout_s)
    groups = {id(g): g for m in dims.all_meshes() for g in m.get_all_groups()}
    return made, count, {g._get_backend(torch.device("cpu")).options._timeout for g in groups.values()}


@contextlib.contextmanager
def recorded_compile_modes() -> Iterator[list]:
    """Within: torch.compile records the mode each call asks for (into the yielded list), then compiles eagerly (the
    mode is inductor's, which CPU tests do not need)."""
    modes: list = []
    compile_ = torch.compile

    def recording(fn=None, **kwargs):
        modes.append(kwargs.get("mode"))
        return compile_(fn, backend="eager", **{k: v for k, v in kwargs.items() if k not in ("mode", "backend")})

    torch.compile = recording
    try:
        yield modes
    finally:
        torch.compile = compile_
