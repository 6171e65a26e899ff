"""``meshrun trace``: where the GPU time of profiled steps went, from the traces ``run.profile_steps`` writes.

A step is as fast as its slowest resource. This reads a torch profiler (Chrome) trace and splits the recorded span
of the GPU into four parts, all measured on the device's own timeline:

- compute: some non-communication kernel, copy or memset ran;
- overlapped communication: a collective (NCCL kernel) ran beside compute, hidden;
- exposed communication: only collectives ran; the step waited for the network;
- idle: no kernel at all; the GPU waited for the host to launch work (Python and launch overhead, a host sync,
  data loading).

The largest of idle and exposed communication names what bounds the step (``verdict``). For example, the 124m model
on two H100s with DDP spent 20% of its recorded span idle: the host launched the forward's kernels more slowly than
the GPU ran them.

Given the traces of several ranks of one recording (``run.profile_ranks=all``), it also compares their compute: the
ranks of a step wait for the busiest one, so a rank that computes much more than the others is what the others'
waits are made of (a pipeline stage with more blocks, or a slower GPU).

The profiler slows the host itself, most where a step launches many small ops: a 1b FSDP step on two H100s took
165 ms under it, 48 ms of them idle, and 117 ms without it, its kernels' busy time. Given a run folder, the
verdict therefore weighs the idle time against the run's unprofiled steps (``metrics.jsonl``): only the part of
an unprofiled step that the kernels do not fill counts as waiting for the host.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import statistics
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

from meshrun.help_format import PlainHelpFormatter

KERNEL_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
KERNEL_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", ("nccl",)),
    ("attention", ("flash", "fmha", "sdpa", "attention", "attn")),
    ("matmuls", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "wgmma", "s16816", "triton_tem")),
    ("optimizer and norms (multi-tensor)", ("multi_tensor_apply", "adam", "foreach")),
    ("fused element-wise (compiled)", ("triton",)),
    ("copies and casts", ("copy", "memcpy", "memset", "chunk_cat", "split_with_sizes")),
    ("element-wise and reductions (eager)", ("elementwise_kernel", "reduce_kernel")),
)
"""What a kernel's name says it is, the first match winning (lower-cased substrings; CUDA, cuBLAS, cuDNN, Triton and
NCCL names as the torch profiler records them). A cast is a copy kernel; gradient accumulation an eager add."""
OTHER_KIND = "other"
COLLECTIVES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("all-reduce", ("allreduce",)),
    ("all-gather", ("allgather",)),
    ("reduce-scatter", ("reducescatter",)),
    ("send/receive", ("sendrecv", "_send", "_recv")),
    ("broadcast", ("broadcast",)),
)
"""Which collective an NCCL kernel runs, from its name (``ncclDevKernel_AllReduce_Sum_bf16_RING_LL``)."""
EXPOSED_HINTS = {
    "all-reduce": "DDP's gradient all-reduce overlaps backward when the compiled step is split at its buckets "
                  "(parallel.ddp_graph=split, smaller parallel.ddp_bucket_mb); TP's backward all-reduces run beside "
                  "the weight gradients where inductor reorders the compiled blocks (parallel.comm_reorder, on by "
                  "default for TP on GPUs), its forward ones beside nothing, so fewer TP ranks (more data "
                  "parallelism) or sequence parallelism with parallel.async_tp move them off the step",
    "all-gather": "FSDP2's all-gathers: larger units (parallel.fsdp_unit_blocks), gathered parameters kept for "
                  "backward (parallel.fsdp_reshard_after_forward=false), or fewer shards (HSDP's "
                  "parallel.dp_replicate)",
    "reduce-scatter": "FSDP2's gradient reduce-scatters: larger units (parallel.fsdp_unit_blocks), or bf16 "
                      "reduction (parallel.grad_reduce_dtype=bf16, auto's choice for FSDP2 on the GPUs of one node "
                      "with one micro-batch per step; the kernel's name says which dtype ran: _bf16 or _f32)",
    "send/receive": "the pipeline's stages wait for each other (its bubble, or unequal stages): more micro-batches "
                    "(parallel.pp_microbatches; keep each at 4096 tokens or more, below which their fixed cost "
                    "outweighs the bubble they save, and parallel.pp_microbatches=0 weighs the two), more samples "
                    "per step (train.grad_accum), stages cut by cost (parallel.pp_balance=cost), or an interleaved "
                    "schedule (parallel.pp_schedule=interleaved1f1b, auto's choice for a pipeline alone on GPUs: a "
                    "smaller bubble, but more sends and receives, whose kernels share the GPU with compute; held to 4 "
                    "NCCL channels, parallel.pp_p2p_channels' default for it, 1.024-1.027x of 1f1b for the 1b model "
                    "on 2 H200s, 0.99x with NCCL's own count)",
}
"""What a step bound by that collective can try (``StepTime.verdict``)."""
BOUND_SHARE = 0.10
"""Idle or exposed communication above this share of the span names the step host- or communication-bound."""
UNEVEN_COMPUTE = 0.05
"""Ranks of one recording whose compute per step differs by more than this share are called uneven."""


@dataclass(frozen=True)
class StepTime:
    """One trace's device timeline, in milliseconds per recorded step."""

    path: str
    steps: int
    span_ms: float
    compute_ms: float
    comm_ms: float
    exposed_comm_ms: float
    idle_ms: float
    top_kernels: list[tuple[str, float]] = field(default_factory=list)
    """The kernels with the most device time per step (name, ms), communication included."""
    unprofiled_ms: float | None = None
    """The run's step time without the profiler (median of its logged intervals), when known."""
    by_kind: list[tuple[str, float]] = field(default_factory=list)
    """Kernel time per step (ms) by what the kernels are (:data:`KERNEL_KINDS`), the largest first."""
    exposed_by_collective: list[tuple[str, float]] = field(default_factory=list)
    """Exposed communication per step (ms) by collective (:data:`COLLECTIVES`), the largest first; two collectives
    running at once, both exposed, count in each."""

    def verdict(self) -> str:
        busy = self.span_ms - self.idle_ms
        if self.unprofiled_ms is None:
            base, idle_ms, where = max(self.span_ms, 1e-9), self.idle_ms, "the span"
        else:  # idle that an unprofiled step does not have was the profiler's own host time
            base, idle_ms = max(self.unprofiled_ms, busy, 1e-9), max(0.0, self.unprofiled_ms - busy)
            where = "an unprofiled step"
        idle, exposed = idle_ms / base, self.exposed_comm_ms / base
        if idle >= BOUND_SHARE and idle >= exposed:
            text = (f"host-bound: the GPU idled {idle:.0%} of {where} waiting for work; less host time per step "
                    "helps (compile, CUDA graphs with train.cuda_graphs, fewer and larger kernels, no host syncs)")
        elif exposed >= BOUND_SHARE:
            top = self.exposed_by_collective[0][0] if self.exposed_by_collective else ""
            hint = (f"most of it {top}: {EXPOSED_HINTS[top]}" if top in EXPOSED_HINTS
                    else "overlap them with compute or move fewer bytes")
            text = f"communication-bound: only collectives ran for {exposed:.0%} of {where}; {hint}"
        else:
            text = (f"compute-bound: kernels kept the GPU busy {1 - idle - exposed:.0%} of {where}; faster kernels "
                    "help (train.float8, train.loss=chunked, a larger micro-batch)")
        if self.unprofiled_ms is not None and self.idle_ms - idle_ms >= BOUND_SHARE * self.span_ms:
            text += (f" (the profiler's own host time left the GPU idle {self.idle_ms:.3g} ms per recorded step; "
                     f"unprofiled steps take {self.unprofiled_ms:.3g} ms against {busy:.3g} ms of kernels)")
        return text


def _first_match(name: str, table: tuple[tuple[str, tuple[str, ...]], ...]) -> str:
    """The first entry of ``table`` with a word in ``name`` (lower-cased), or :data:`OTHER_KIND`."""
    lower = name.lower()
    return next((kind for kind, words in table if any(word in lower for word in words)), OTHER_KIND)


def kernel_kind(name: str, cat: str = "kernel") -> str:
    """The :data:`KERNEL_KINDS` name of one device event (a memcpy or memset event is a copy whatever its name)."""
    return "copies and casts" if cat in ("gpu_memcpy", "gpu_memset") else _first_match(name, KERNEL_KINDS)


def collective(name: str) -> str:
    """The :data:`COLLECTIVES` name of an NCCL kernel ('other' for one it does not name)."""
    return _first_match(name, COLLECTIVES)


def union_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by (start, end) intervals, overlaps counted once."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def read_trace(path: Path) -> dict[str, Any]:
    """A Chrome trace as written by ``torch.profiler`` (``.json``, or ``.json.gz``)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")  # the host's launch calls (cudaLaunchKernel, cudaGraphLaunch)


def recorded_kernels(events: list[dict[str, Any]]) -> tuple[int, list[dict[str, Any]]]:
    """How many steps a trace recorded (its ``ProfilerStep#N`` marks), and the device events launched in them.

    A host that runs ahead of its GPU (CUDA graphs, and any step without a host sync) starts the profiler while
    the GPU still runs work it queued earlier. Those kernels are in the trace too, though their launches are not, and
    counting them charged up to half as much again to each recorded step: a 124m DDP step as CUDA graphs read 46 ms
    per step where its recorded launches ran 34. So a device event counts when the trace holds its launch (linked
    by the profiler's ``correlation`` id), made within the recorded steps; every one counts in a trace without
    launch events."""
    marks = [e for e in events if e.get("cat") != "gpu_user_annotation"
             and str(e.get("name", "")).startswith("ProfilerStep#")]
    steps = len({e["name"] for e in marks}) or 1
    device = [e for e in events if e.get("cat") in KERNEL_CATEGORIES]
    launches = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    if not launches:
        return steps, device
    start = min((e["ts"] for e in marks), default=float("-inf"))
    end = max((e["ts"] + e["dur"] for e in marks), default=float("inf"))
    return steps, [e for e in device if start <= launches.get(e.get("args", {}).get("correlation"), start - 1) <= end]


def step_time(trace: dict[str, Any], path: str = "", *, top: int = 8) -> StepTime | None:
    """The breakdown of one trace over the kernels launched in its recorded steps (:func:`recorded_kernels`); None
    when it holds no device kernels (a CPU run)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    steps, kernels = recorded_kernels(events)
    if not kernels:
        return None
    is_comm = [("nccl" in e["name"].lower()) for e in kernels]
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in kernels]
    comm = [s for s, c in zip(spans, is_comm) if c]
    compute = [s for s, c in zip(spans, is_comm) if not c]
    busy, compute_us, comm_us = union_us(spans), union_us(compute), union_us(comm)
    span_us = max(end for _, end in spans) - min(start for start, _ in spans)
    by_name: collections.Counter[str] = collections.Counter()
    by_kind: collections.Counter[str] = collections.Counter()
    for e in kernels:
        by_name[e["name"]] += e["dur"]
        by_kind[kernel_kind(e["name"], e["cat"])] += e["dur"]
    per_step = 1e3 * steps  # microseconds of the whole trace -> milliseconds per step
    by_collective: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    for e, s, c in zip(kernels, spans, is_comm):
        if c:
            by_collective[collective(e["name"])].append(s)
    # a collective's exposed time: what its kernels cover beyond the compute kernels' cover
    exposed = sorted(((name, (union_us([*spans_of, *compute]) - compute_us) / per_step)
                      for name, spans_of in by_collective.items()), key=lambda item: -item[1])
    return StepTime(path=path, steps=steps, span_ms=span_us / per_step, compute_ms=compute_us / per_step,
                    comm_ms=comm_us / per_step, exposed_comm_ms=(busy - compute_us) / per_step,
                    idle_ms=(span_us - busy) / per_step,
                    top_kernels=[(name, us / per_step) for name, us in by_name.most_common(top)],
                    by_kind=[(kind, us / per_step) for kind, us in by_kind.most_common()],
                    exposed_by_collective=[(name, ms) for name, ms in exposed if ms > 0])


def describe_step_time(t: StepTime) -> str:
    """The lines the profiler adds to its summary file, and ``meshrun trace`` prints per trace."""
    lines = [f"GPU timeline per step ({t.steps} step(s) recorded): span {t.span_ms:.2f} ms = compute "
             f"{t.compute_ms:.2f} ms + exposed communication {t.exposed_comm_ms:.2f} ms + idle {t.idle_ms:.2f} ms "
             f"(communication {t.comm_ms:.2f} ms in all, {t.comm_ms - t.exposed_comm_ms:.2f} ms of it hidden "
             "behind compute)", t.verdict(),
             *(["exposed communication per step by collective: "
                + ", ".join(f"{name} {ms:.2f} ms" for name, ms in t.exposed_by_collective)]
               if t.exposed_by_collective else []),
             "kernel time per step by kind (overlaps counted in each): "
             + ", ".join(f"{kind} {ms:.2f} ms" for kind, ms in t.by_kind),
             "kernels with the most time per step:"]
    lines += [f"  {ms:8.3f} ms  {name[:110]}" for name, ms in t.top_kernels]
    return "\n".join(lines)


def unprofiled_step_ms(run_dir: Path) -> float | None:
    """The median step time (ms) of a run folder's logged intervals that hold no profiled step nor the step after the
    window (which pays for writing the trace), leaving out the first interval after each start (compilation and
    warm-up); None without a metrics.jsonl or such intervals."""
    from meshrun.config import ConfigError, RunConfig
    from meshrun.config_load import tomllib

    metrics, config = run_dir / "metrics.jsonl", run_dir / "config.toml"
    if not metrics.is_file():
        return None
    try:
        steps = tomllib.loads(config.read_text()).get("run", {}).get("profile_steps", "") if config.is_file() else ""
        window = RunConfig(profile_steps=str(steps)).profile_window() or (0, -1)
    except (OSError, ValueError, ConfigError):
        window = (0, -1)
    times, previous, first = [], 0, True
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line cut short by a crash
            continue
        if record.get("kind") == "start":
            previous, first = int(record.get("step", 0)), True
        elif record.get("kind") == "train" and record.get("step_time_s"):
            step = int(record["step"])
            if not first and (step < window[0] or previous > window[1]):  # after the window: its trace export
                times.append(float(record["step_time_s"]))
            previous, first = step, False
    return 1e3 * statistics.median(times) if times else None


def run_step_time(trace: Path, *, unprofiled: dict[Path, float | None] | None = None) -> StepTime | None:
    """:func:`step_time` of a trace file, with the unprofiled step time of the run folder it lies in (``<run.dir>/
    profile/rank_<N>.json``) when that folder has a metrics.jsonl. ``unprofiled`` caches the folders' values."""
    t = step_time(read_trace(trace), str(trace))
    if t is None:
        return None
    if (trace.parent / "slowdown.json").is_file():  # run.profile_on_slowdown: the slow interval's own step time
        return replace(t, unprofiled_ms=slowdown_step_ms(trace.parent / "slowdown.json"))
    run_dir = trace.parent.parent if trace.parent.name == "profile" else trace.parent
    cache = {} if unprofiled is None else unprofiled
    if run_dir not in cache:
        cache[run_dir] = unprofiled_step_ms(run_dir)
    return replace(t, unprofiled_ms=cache[run_dir])


def slowdown_step_ms(path: Path) -> float | None:
    """The step time (ms) of the slow interval that a run.profile_on_slowdown recording followed."""
    try:
        return 1e3 * float(json.loads(path.read_text())["step_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def trace_files(paths: list[str]) -> list[Path]:
    """Trace files named directly, or every ``profile/rank_*.json`` of a run folder (or of a profile folder), those
    of its ``slowdown_*`` recordings (run.profile_on_slowdown) after them."""
    found: list[Path] = []
    for name in paths:
        p = Path(name)
        if p.is_dir():
            folder = p / "profile" if (p / "profile").is_dir() else p
            for where in (folder, *sorted(folder.glob("slowdown_*"))):
                found += sorted(where.glob("rank_*.json")) + sorted(where.glob("rank_*.json.gz"))
        else:
            found.append(p)
    return found


def trace_rank(path: str) -> int | None:
    """The rank a trace file's name gives (``rank_00003.json`` -> 3), or None."""
    found = re.search(r"rank_(\d+)\.json", Path(path).name)
    return int(found.group(1)) if found else None


def uneven_compute(rows: list[StepTime]) -> list[str]:
    """A line for each recording (traces in one folder, from two ranks or more) whose ranks' compute per step differs
    by more than :data:`UNEVEN_COMPUTE`: the busiest rank sets the step's pace, and the others wait for it."""
    folders: dict[str, list[tuple[int, StepTime]]] = collections.defaultdict(list)
    for t in rows:
        rank = trace_rank(t.path)
        if rank is not None:
            folders[str(Path(t.path).parent)].append((rank, t))
    lines = []
    for folder, ranks in folders.items():
        if len(ranks) < 2:
            continue
        (low_rank, low), (high_rank, high) = (min(ranks, key=lambda r: r[1].compute_ms),
                                              max(ranks, key=lambda r: r[1].compute_ms))
        extra = high.compute_ms / max(low.compute_ms, 1e-9) - 1
        if extra <= UNEVEN_COMPUTE:
            continue
        lines.append(
            f"{folder}: uneven ranks: rank {high_rank} computes {high.compute_ms:.1f} ms per step, {extra:.0%} more "
            f"than rank {low_rank} ({low.compute_ms:.1f} ms), and the other ranks wait for it within each step. In a "
            "pipeline its stages hold more work: the cut is in whole blocks (parallel.pp_balance=cost, the default, "
            "evens the estimated FLOPs; =blocks evens the block counts), so a block count that splits more evenly "
            "over the stages helps; where every rank runs the same kernels (data parallelism), a slower GPU "
            "(clocks, power, temperature: meshrun doctor) or uneven batches")
    return lines


def render_table(rows: list[StepTime]):
    from rich.table import Table

    table = Table(title="GPU time per recorded step (ms)", title_justify="left")
    for name in ("trace", "steps", "span", "compute", "exposed comm", "hidden comm", "idle", "unprofiled step",
                 "bound by"):
        table.add_column(name, justify="left" if name in ("trace", "bound by") else "right")
    for t in rows:
        table.add_row(t.path, str(t.steps), f"{t.span_ms:.2f}", f"{t.compute_ms:.2f}", f"{t.exposed_comm_ms:.2f}",
                      f"{t.comm_ms - t.exposed_comm_ms:.2f}", f"{t.idle_ms:.2f}",
                      "-" if t.unprofiled_ms is None else f"{t.unprofiled_ms:.2f}", t.verdict().split(":")[0])
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="meshrun trace", description=__doc__.split("\n\n")[0],
                                formatter_class=PlainHelpFormatter)
    p.add_argument("paths", nargs="+",
                   help="run folders (their profile/rank_*.json and profile/slowdown_*/rank_*.json) or trace files")
    p.add_argument("--json", action="store_true", help="print one JSON object per trace instead of a table")
    p.add_argument("--kernels", action="store_true", help="also list each trace's kernels with the most time")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    files = trace_files(args.paths)
    missing = [f for f in files if not f.is_file()]
    if missing or not files:
        where = missing[0] if missing else " ".join(args.paths)
        print(f"meshrun trace: error: no trace at {where}; record one with meshrun train --profile (or "
              "--run.profile_steps=20-22) and give the run folder or its profile/rank_<N>.json", file=sys.stderr)
        return 2
    rows, cpu_only = [], []
    unprofiled: dict[Path, float | None] = {}
    for f in files:
        t = run_step_time(f, unprofiled=unprofiled)
        if t is None:
            cpu_only.append(f)
        else:
            rows.append(t)
    if args.json:
        print("\n".join(json.dumps({**asdict(t), "verdict": t.verdict()}) for t in rows))
    else:
        from rich.console import Console

        console = Console(width=None if sys.stdout.isatty() else 160)
        if rows:
            console.print(render_table(rows))
        for line in uneven_compute(rows):
            console.print(line, markup=False)
        for t in rows if args.kernels else []:
            console.print(f"\n{t.path}\n{describe_step_time(t)}", markup=False)
    for f in cpu_only:
        print(f"{f}: no GPU kernels (a CPU run); its rank_<N>_summary.txt lists the ops with the most CPU time",
              file=sys.stderr)
    return 0
