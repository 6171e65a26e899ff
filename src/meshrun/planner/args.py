"""``meshrun plan``'s options: the same ``--config`` and ``--section.key=value`` options as ``meshrun train``
(read by config.load_config), short aliases of the most used ones, and the options of the planner itself."""

from __future__ import annotations

import argparse

from meshrun.config import (ACTIVATION_CHECKPOINT_MODES, DATA_PARALLEL_MODES, PIPELINE_BALANCES, PIPELINE_SCHEDULES,
                            TRAIN_DTYPES, ConfigError, JobConfig, join_overrides, load_config)
from meshrun.comm.axes import AXES, MESH_DIMS
from meshrun.help_format import PlainHelpFormatter

DESCRIPTION = "``meshrun plan``: an offline look at a parallel layout before any GPU is allocated."

EPILOG = """\
job options: the same as `meshrun train`'s. --config job.toml, then --section.key=value (or --section.key value)
overrides, e.g. --parallel.tp=2 --model.name=1b --train.global_batch=512 (`meshrun train --help` and
docs/config.md list every option).
The short flags above are aliases of those options (--tp 2 is --parallel.tp=2); give one form per option.
Without --config, --model or --model.name the model is 124m.

examples:
  meshrun plan --nodes 4 --gpus-per-node 8 --model 124m --micro-batch 8 --grad-accum 2
  meshrun plan --nodes 8 --gpus-per-node 8 --model 1b --tp 4 --pp 2 --dp-replicate -1
  meshrun plan --nodes 8 --model.name=1b --parallel.tp=4 --parallel.pp=2 --parallel.pp_microbatches=16
  meshrun plan --nodes 64 --hidden 12288 --heads 96 --ffn 49152 --layers 96 --tp 8 --pp 8 --json
  meshrun plan --config job.toml --nodes 2 --gpus-per-node 8 --train.micro_batch=4 --dry-run
  meshrun plan --nodes 16 --tp 8 --pp 4 --model 1b --params 100B --tokens 1T --tokens-per-s 45000
  meshrun plan --arch my_models:mlp_lm --model small --tp 2      (a model registered with meshrun.register_model)
"""

ALIASES: dict[str, str] = {
    "arch": "model.arch", "model": "model.name", "hidden": "model.dim", "layers": "model.n_layers",
    "heads": "model.n_heads", "kv_heads": "model.n_kv_heads", "vocab": "model.vocab_size", "seq": "model.seq_len",
    "ffn": "model.ffn_dim", "untied": "model.tie_embeddings",
    **{name: f"parallel.{name}" for name in MESH_DIMS},
    "pp_schedule": "parallel.pp_schedule", "pp_microbatches": "parallel.pp_microbatches",
    "pp_virtual_stages": "parallel.pp_virtual_stages", "pp_balance": "parallel.pp_balance",
    "sequence_parallel": "parallel.sequence_parallel",
    "activation_checkpoint": "parallel.activation_checkpoint", "data_parallel": "parallel.data_parallel",
    "allow_tp_across_nodes": "parallel.allow_tp_across_nodes",
    "micro_batch": "train.micro_batch", "grad_accum": "train.grad_accum", "global_batch": "train.global_batch",
    "dtype": "train.dtype",
}
"""Short flag (its argparse dest) -> the config option it sets."""


def _alias(group, flag: str, what: str, **kwargs) -> None:
    """A short flag for the config option ALIASES names; its help says which option that is."""
    option = ALIASES[flag.replace("-", "_")]
    value = f"={kwargs['const']}" if "const" in kwargs else ""
    group.add_argument(f"--{flag}", help=f"{what} (= --{option}{value})", **kwargs)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The planner's options; ``args.overrides`` holds the ``--section.key=value`` items. Raises ConfigError for
    an argument that is neither."""
    p = argparse.ArgumentParser(prog="meshrun plan", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=PlainHelpFormatter)
    p.add_argument("--config", help="TOML job config to start from, as for `meshrun train`")
    p.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs (processes) per node (default 8)")
    _add_model_aliases(p.add_argument_group("model (aliases: a registered model, its named size, field overrides)"))
    _add_layout_aliases(p.add_argument_group("layout (aliases; -1 infers a degree from the world size)"))
    b = p.add_argument_group("batch (aliases)")
    _alias(b, "micro-batch", "samples per micro-batch per data-parallel rank (B_local)", type=int)
    _alias(b, "grad-accum", "micro-batches per optimizer step (A)", type=int)
    _alias(b, "global-batch", "samples per optimizer step (derives A)", type=int)
    _alias(b, "dtype", "compute dtype (default auto: bf16, as training picks on GPUs of compute capability 8.0+)",
           choices=TRAIN_DTYPES)
    _add_planner_options(p)
    args, rest = p.parse_known_args(argv)
    flags = [flag for action in p._actions for flag in action.option_strings if flag.startswith("--")]
    args.overrides = join_overrides(rest, command="meshrun plan", flags=flags)
    return args


def _add_model_aliases(m) -> None:
    _alias(m, "arch", "registered model; 'module:name' imports module first (default gpt)")
    _alias(m, "model", "named size of the model (gpt: tiny, small, 124m, 350m, 1b; default 124m, or the config's)")
    for flag, what in (("hidden", "hidden size"), ("layers", "transformer blocks"), ("heads", "attention heads"),
                       ("kv-heads", "key/value heads (GQA)"), ("vocab", "vocabulary size"),
                       ("seq", "sequence length"), ("ffn", "MLP hidden width")):
        _alias(m, flag, what, type=int)
    _alias(m, "untied", "untied input/output embeddings", action="store_const", const="false")


def _add_layout_aliases(d) -> None:
    for axis in AXES:
        _alias(d, axis.name.replace("_", "-"), f"degree: splits {axis.splits}", type=int)
    _alias(d, "data-parallel", "auto (FSDP2 from 1B parameters on GPUs), ddp or fsdp", choices=DATA_PARALLEL_MODES)
    _alias(d, "pp-schedule", "pipeline schedule", choices=PIPELINE_SCHEDULES)
    _alias(d, "pp-balance", "cut the blocks into stages by estimated cost or by count", choices=PIPELINE_BALANCES)
    _alias(d, "pp-microbatches", "pipeline micro-batches per step (0: the bubble weighed against each one's cost)",
           type=int)
    _alias(d, "pp-virtual-stages", "stages per rank for interleaved1f1b, interleavedzb and loopedbfs", type=int)
    _alias(d, "sequence-parallel", "shard norms along the sequence", action="store_const", const="true")
    _alias(d, "activation-checkpoint", "none, selective or full", choices=ACTIVATION_CHECKPOINT_MODES)
    _alias(d, "allow-tp-across-nodes", "permit TP groups that span nodes", action="store_const", const="true")


def _add_planner_options(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("time for a token budget (6 x N x tokens FLOPs)")
    t.add_argument("--tokens", help="token budget, e.g. 1T or 300B: prints the wall-clock estimate")
    t.add_argument("--params", help="N for the FLOP count, e.g. 100B (default: the model's parameters)")
    t.add_argument("--mfu", type=float, help="assumed model FLOPs utilisation (default 0.4)")
    t.add_argument("--peak-tflops", type=float, help="dense bf16 peak per GPU in TFLOP/s (default 989, an H100)")
    t.add_argument("--tokens-per-s", type=float, help="throughput of the whole job, measured or expected")
    t.add_argument("--from-run", help="take --tokens-per-s from this run directory's summary.json")
    o = p.add_argument_group("output")
    o.add_argument("--gpu-mem-gib", type=float, default=80.0, help="GPU memory for the fit check (default 80)")
    o.add_argument("--ranks", default="auto", help="rank table rows: auto (<= 64 ranks, else first two and last "
                   "node), all, or a number N (the first N ranks)")
    o.add_argument("--json", action="store_true", help="print JSON instead of tables")
    o.add_argument("--dry-run", action="store_true", help="also apply the layout on a fake process group")
    o.add_argument("--dry-run-ranks", default="", help="comma-separated ranks to simulate (default: first, last)")


def job_from_args(args: argparse.Namespace) -> JobConfig:
    """The config file (if any), then the short flags and the ``--section.key=value`` overrides, validated."""
    flags = {option: (dest, getattr(args, dest)) for dest, option in ALIASES.items()
             if getattr(args, dest) is not None}
    dotted = {item.lstrip("-").partition("=")[0] for item in args.overrides}
    for option in sorted(flags.keys() & dotted):
        flag = "--" + flags[option][0].replace("_", "-")
        raise ConfigError(f"{flag} and --{option} both set {option}; give only one of them")
    overrides = [f"{option}={value}" for option, (_, value) in flags.items()] + list(args.overrides)
    if args.config is None and not {"model.name", "model.arch"} & (flags.keys() | dotted):
        overrides.insert(0, "model.name=124m")
    return load_config(args.config, overrides)
