"""``meshrun sample CHECKPOINT``: print what the reference model writes after a prompt.

Loads any checkpoint of the reference model on one process, whatever layout saved it (DDP, FSDP, TP, PP: the
weights are read whole through DCP), with the model shape from the config the checkpoint carries (the run's
``config.toml`` for checkpoints of an older meshrun, which did not store it). Byte-level text only
(the standard library corpus and text files): the prompt's UTF-8 bytes are the tokens.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from meshrun.ckpt import access
from meshrun.ckpt.errors import CheckpointError
from meshrun.ckpt.reader import resolve_checkpoint  # noqa: F401 - also meshrun.sample's, for report/cli
from meshrun.config import ConfigError, JobConfig, load_config
from meshrun.help_format import PlainHelpFormatter

EPILOG = """\
examples:
  meshrun sample runs/default --prompt "def " --tokens 200
  meshrun sample runs/default/checkpoints/step_0000300 --temperature 0 --prompt "import "
  meshrun sample s3://bucket/run1/checkpoints --config runs/run1/config.toml
CHECKPOINT may be a checkpoint directory (or its manifest.json), a checkpoints folder or a run directory (the newest
complete one is used).
--config's checkpoint.storage_options (endpoint_url, ...) open an s3:// or gs:// CHECKPOINT.
"""


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="meshrun sample", description=__doc__.split("\n\n")[0], epilog=EPILOG,
                                formatter_class=PlainHelpFormatter)
    p.add_argument("checkpoint", help="checkpoint directory, checkpoints folder or run directory")
    p.add_argument("--prompt", default="def ", help="text to continue (default 'def ')")
    p.add_argument("--tokens", type=int, default=200, help="tokens (bytes) to generate (default 200)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = all)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the sampling (default 0)")
    p.add_argument("--config", help="a config.toml (or a run directory) to use instead of the config the checkpoint "
                                    "carries; its checkpoint.storage_options open an s3:// or gs:// CHECKPOINT")
    return p.parse_args(argv)


def option_error(args: argparse.Namespace) -> str | None:
    """The first sampling option that cannot work, in one line naming it and the fix; None when all can."""
    if args.tokens < 1:
        return f"--tokens {args.tokens}: give 1 or more"
    if not args.temperature >= 0 or args.temperature == float("inf"):  # `not >=` also refuses nan
        return f"--temperature {args.temperature:g}: give 0 (greedy) or more, e.g. 0.8"
    if args.top_k < 0:
        return f"--top-k {args.top_k}: give 0 (all tokens) or a number of the most likely tokens, e.g. 40"
    return None


def find_config(step_dir: Path | str, explicit: str | None) -> JobConfig:
    """The run's config: --config, else the one the checkpoint carries, else (a checkpoint of an older meshrun)
    config.toml in the run directory above the checkpoints folder."""
    from meshrun.ckpt.manifest import data_location, read_manifest
    from meshrun.ckpt.run_config import job_from_dict, saved_embeddings_tied, trained_config

    try:
        manifest = read_manifest(data_location(step_dir))
    except CheckpointError:
        manifest = None  # verified (and named) when the weights are loaded
    if explicit:  # a run's config.toml says tie_embeddings as given: the checkpoint says how the weights were trained
        job = load_config(explicit)
        tied = saved_embeddings_tied(manifest) if manifest is not None else None
        if tied is not None:
            job.model.tie_embeddings = tied
        return job
    stored = trained_config(manifest) if manifest is not None else None  # tie_embeddings as the weights were trained
    if stored is not None:
        return job_from_dict(stored)
    if not isinstance(step_dir, Path):
        raise ConfigError(f"{step_dir}: this checkpoint carries no config (an older meshrun) and an object store has "
                          "no run directory above it; pass --config RUN_DIR/config.toml (the run's config)")
    for folder in (step_dir.parent.parent, step_dir.parent, step_dir):
        if (folder / "config.toml").is_file():
            return load_config(folder / "config.toml")
    raise ConfigError(f"{step_dir}: no config.toml in the run directory above it; pass --config RUN_DIR/config.toml")


def load_model(step_dir: Path | str, job: JobConfig):
    """The reference model with the checkpoint's weights, on the CPU, in fp32."""
    from meshrun.ckpt.reader import load_model_weights
    from meshrun.models.build import model_shape
    from meshrun.models.gpt import GPT

    cfg = model_shape(job)
    manifest, weights = load_model_weights(step_dir, purpose="sample from")
    model = GPT(cfg)
    try:
        model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=True)
    except RuntimeError as exc:
        raise CheckpointError(f"{step_dir}: its weights do not fit the model of the config found "
                              f"({str(exc).splitlines()[0]}); pass the run's --config") from None
    return model, manifest


def main(argv: list[str] | None = None) -> int:
    from meshrun.models.generate import generate

    args = parse_args(sys.argv[1:] if argv is None else argv)
    problem = option_error(args)
    if problem:
        print(f"meshrun sample: error: {problem}", file=sys.stderr)
        return 2
    location = args.checkpoint
    try:
        explicit = access.job_config(args.config) if args.config else None
        location, note = access.open_location(args.checkpoint, explicit)  # a URL: fails within seconds, in one line
        if note:
            print(f"# {note}", file=sys.stderr)
        step_dir = resolve_checkpoint(location)
        job = explicit if explicit is not None else find_config(step_dir, None)
        if job.model.vocab_size and job.model.vocab_size > 256:
            raise ConfigError(f"{step_dir}: model.vocab_size={job.model.vocab_size} is not byte-level text; "
                              "meshrun sample decodes bytes only")
        model, manifest = load_model(step_dir, job)
    except (CheckpointError, ConfigError) as exc:
        print(f"meshrun sample: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # the store's failures as `meshrun ckpt` words them (botocore's are not OSErrors)
        line = access.failure_line(exc, location)
        if line is None:
            raise  # not an expected failure: its traceback
        print(f"meshrun sample: error: {line}", file=sys.stderr)
        return 2
    prompt = list(args.prompt.encode()) or [10]  # an empty prompt starts after a newline
    out = generate(model, prompt, tokens=args.tokens, temperature=args.temperature, top_k=args.top_k,
                   generator=torch.Generator().manual_seed(args.seed))
    print(f"# {step_dir} (step {manifest['step']}), temperature {args.temperature}, top-k {args.top_k or 'all'}",
          file=sys.stderr)
    print(args.prompt + bytes(out).decode("utf-8", errors="replace"))
    return 0
