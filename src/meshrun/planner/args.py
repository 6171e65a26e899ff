"""``meshrun plan``'s options: parsing them, and the job config they describe."""

from __future__ import annotations

import argparse

from meshrun.config import ACTIVATION_CHECKPOINT_MODES, PIPELINE_SCHEDULES, TRAIN_DTYPES, JobConfig, load_config

DESCRIPTION = "``meshrun plan``: an offline look at a parallel layout before any GPU is allocated."

EPILOG = """\
examples:
  meshrun plan --nodes 4 --gpus-per-node 8 --model 124m --micro-batch 8 --grad-accum 2
  meshrun plan --nodes 8 --gpus-per-node 8 --model 1b --tp 4 --pp 2 --dp-replicate -1
  meshrun plan --nodes 64 --hidden 12288 --heads 96 --ffn 49152 --layers 96 --tp 8 --pp 8 --json
  meshrun plan --config job.toml --nodes 2 --gpus-per-node 8 --dry-run
  meshrun plan --nodes 16 --tp 8 --pp 4 --model 1b --params 100B --tokens 1T --tokens-per-s 45000
  meshrun plan --arch my_models:mlp_lm --model small --tp 2      (a model registered with meshrun.register_model)
"""



def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="meshrun plan", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="TOML job config to start from (its [model], [parallel], [train] sections)")
    p.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs (processes) per node (default 8)")
    m = p.add_argument_group("model (a registered model and its named size, then any of these overrides)")
    m.add_argument("--arch", help="registered model (model.arch; 'module:name' imports module first; default gpt)")
    m.add_argument("--model", help="named size of the model (gpt: tiny, small, 124m, 350m, 1b; default 124m, "
                   "or the config's)")
    for flag, what in (("hidden", "hidden size (model.dim)"), ("layers", "transformer blocks"),
                       ("heads", "attention heads"), ("kv-heads", "key/value heads (GQA)"),
                       ("vocab", "vocabulary size"), ("seq", "sequence length"), ("ffn", "MLP hidden width")):
        m.add_argument(f"--{flag}", type=int, help=what)
    m.add_argument("--untied", action="store_true", help="untied input/output embeddings")
    d = p.add_argument_group("layout (-1 infers a degree from the world size)")
    for flag in ("dp-replicate", "dp-shard", "tp", "pp"):
        d.add_argument(f"--{flag}", type=int, help=f"parallel.{flag.replace('-', '_')}")
    d.add_argument("--pp-schedule", choices=PIPELINE_SCHEDULES)
    d.add_argument("--pp-microbatches", type=int, help="pipeline micro-batches per step (0: 2 x pp)")
    d.add_argument("--pp-virtual-stages", type=int, help="stages per rank for interleaved1f1b")
    d.add_argument("--sequence-parallel", action="store_true", default=None, help="shard norms along the sequence")
    d.add_argument("--activation-checkpoint", choices=ACTIVATION_CHECKPOINT_MODES)
    d.add_argument("--allow-tp-across-nodes", action="store_true", default=None)
    b = p.add_argument_group("batch")
    b.add_argument("--micro-batch", type=int, help="samples per micro-batch per data-parallel rank (B_local)")
    b.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step (A)")
    b.add_argument("--global-batch", type=int, help="samples per optimizer step (derives A)")
    b.add_argument("--dtype", choices=[d for d in TRAIN_DTYPES if d != "auto"], default="bf16", help="compute dtype (default bf16)")
    t = p.add_argument_group("time for a token budget (6 x N x tokens FLOPs)")
    t.add_argument("--tokens", help="token budget, e.g. 1T or 300B: prints the wall-clock estimate")
    t.add_argument("--params", help="N for the FLOP count, e.g. 100B (default: the model's parameters)")
    t.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilisation (default 0.4)")
    t.add_argument("--peak-tflops", type=float, default=0.0,
                   help="dense bf16 peak per GPU in TFLOP/s (default 989, an H100)")
    t.add_argument("--tokens-per-s", type=float, help="throughput of the whole job, measured or expected")
    t.add_argument("--from-run", help="take --tokens-per-s from this run directory's summary.json")
    o = p.add_argument_group("output")
    o.add_argument("--gpu-mem-gib", type=float, default=80.0, help="GPU memory for the fit check (default 80)")
    o.add_argument("--ranks", default="auto", help="rank table rows: auto (<= 64 ranks, else first two and last "
                   "node), all, or a number N (the first N ranks)")
    o.add_argument("--json", action="store_true", help="print JSON instead of tables")
    o.add_argument("--dry-run", action="store_true", help="also apply the layout on a fake process group")
    o.add_argument("--dry-run-ranks", default="", help="comma-separated ranks to simulate (default: first, last)")
    return p.parse_args(argv)


def job_from_args(args: argparse.Namespace) -> JobConfig:
    """The config file (if any), then every flag that was given."""
    overrides = []
    flags = {"model.arch": args.arch, "model.name": args.model, "model.dim": args.hidden,
             "model.n_layers": args.layers,
             "model.n_heads": args.heads, "model.n_kv_heads": args.kv_heads, "model.vocab_size": args.vocab,
             "model.seq_len": args.seq, "model.ffn_dim": args.ffn,
             "model.tie_embeddings": False if args.untied else None,
             "parallel.dp_replicate": args.dp_replicate, "parallel.dp_shard": args.dp_shard,
             "parallel.tp": args.tp, "parallel.pp": args.pp, "parallel.pp_schedule": args.pp_schedule,
             "parallel.pp_microbatches": args.pp_microbatches, "parallel.pp_virtual_stages": args.pp_virtual_stages,
             "parallel.sequence_parallel": args.sequence_parallel,
             "parallel.activation_checkpoint": args.activation_checkpoint,
             "parallel.allow_tp_across_nodes": args.allow_tp_across_nodes,
             "train.micro_batch": args.micro_batch, "train.grad_accum": args.grad_accum,
             "train.global_batch": args.global_batch}
    overrides = [f"{key}={value}" for key, value in flags.items() if value is not None]
    if args.config is None and args.model is None and args.arch is None:
        overrides.insert(0, "model.name=124m")
    return load_config(args.config, overrides)

