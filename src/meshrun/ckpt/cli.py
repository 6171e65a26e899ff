"""``meshrun ckpt``: list, verify and export checkpoints. Parsing and printing only; the work is in reader.py.

    meshrun ckpt ls [DIR] [--config TOML]          table of the checkpoints in DIR (or DIR/checkpoints)
    meshrun ckpt verify PATH [--no-checksums]      exit 1, naming each bad file, if PATH (or a run folder's newest
                                                   checkpoint) is not intact or would be refused by a resume
    meshrun ckpt export PATH --to model.safetensors   consolidated model weights of PATH (or of a run folder's
                                                   newest checkpoint) for inference

Exit codes: 0 done; 1 a checkpoint missing, damaged or refused; 2 a wrong command line, a path that does not exist
included.

DIR and PATH may be ``s3://`` or ``gs://`` URLs: credentials and endpoint from the environment, or from the
``checkpoint.storage_options`` of ``--config job.toml`` (or of a run folder's config.toml); a run folder whose
config.toml sets ``checkpoint.dir`` is read there (docs/checkpoints.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console

from meshrun.ckpt import access, reader
from meshrun.ckpt.errors import CheckpointError, CheckpointPathError
from meshrun.ckpt.storage import store_for
from meshrun.config import ConfigError
from meshrun.help_format import PlainHelpFormatter
from meshrun.units import format_bytes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshrun ckpt", description="List, verify and export checkpoints.",
                                     formatter_class=PlainHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{ls,verify,export}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", metavar="TOML", help="a job's config (or a run folder): its "
                        "checkpoint.storage_options open s3:// and gs:// URLs (endpoint_url, profile, ...)")
    ls = sub.add_parser("ls", aliases=["list"], parents=[common],
                        help="list the checkpoints of a folder, complete or not")
    ls.add_argument("dir", nargs="?", help="checkpoint folder or run folder (default: --config's checkpoint "
                    f"folder, else {reader.DEFAULT_FOLDER})")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    verify = sub.add_parser("verify", parents=[common],
                            help="check marker, manifest, sizes and SHA-256 of every file")
    verify.add_argument("path", help="a checkpoint directory (step_NNNNNNN), or a checkpoints or run folder: its "
                        "newest complete checkpoint, the one a resume tries first")
    verify.add_argument("--no-checksums", action="store_true", help="check sizes only (fast)")
    export = sub.add_parser("export", parents=[common],
                            help="write the model weights (no optimizer) as one safetensors file")
    export.add_argument("path", help="a checkpoint directory (step_NNNNNNN), or a checkpoints or run folder: its "
                        "newest complete checkpoint")
    export.add_argument("--to", required=True, type=Path, help="output file, e.g. model.safetensors")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    field = "dir" if args.command in ("ls", "list") else "path"
    location = getattr(args, field) or ""
    try:
        job = access.job_config(args.config) if args.config else None
        if not location and job is not None:  # ls --config job.toml: that job's checkpoint folder
            location = job.checkpoint.dir or str(Path(job.run.dir) / "checkpoints")
        if location:  # a URL is asked first: fails within seconds, naming the URL and what to set
            location, note = access.open_location(location, job)
            if note:
                print(f"meshrun ckpt {args.command}: {note}", file=sys.stderr)
            setattr(args, field, location)
        return {"ls": _ls, "list": _ls, "verify": _verify, "export": _export}[args.command](args)
    except (CheckpointError, ConfigError) as exc:
        print(f"meshrun ckpt {args.command}: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, CheckpointPathError) else 1
    except Exception as exc:  # the store's failures (not all OSErrors: botocore's are not) in one line
        line = access.failure_line(exc, location)
        if line is None and not isinstance(exc, OSError):
            raise  # not an expected failure: its traceback
        print(f"meshrun ckpt {args.command}: {line or f'{type(exc).__name__}: {exc}'}", file=sys.stderr)
        return 1


def _ls(args: argparse.Namespace) -> int:
    folder = reader.resolve_folder(args.dir)
    store = store_for(folder)
    if not store.is_dir(folder):
        what = "is a file, not a folder" if store.exists(folder) else "does not exist"
        print(f"meshrun ckpt ls: {folder} {what}; give the checkpoint folder (checkpoint.dir) or the "
              "run folder (run.dir)", file=sys.stderr)
        return 2
    rows = reader.list_checkpoints(folder)
    if args.json:
        print(json.dumps([{**row.__dict__, "path": row.path} for row in rows], indent=1))
    elif not rows:
        print(f"no checkpoints in {folder}")
    else:
        Console(width=max(Console().width, 140)).print(reader.render_table(rows, folder))
    return 0


def _verify(args: argparse.Namespace) -> int:
    path = reader.resolve_checkpoint(args.path.rstrip("/"))  # a run folder or a checkpoints folder: its newest
    manifest, problems = reader.verify(path, checksums=not args.no_checksums)
    for problem in problems:
        print(f"FAILED {problem}")
    if problems:
        print(f"{path}: {len(problems)} problem(s); do not resume from this checkpoint", file=sys.stderr)
        return 1
    checked = "sizes" if args.no_checksums else "sizes and sha256"
    total = sum(info["size"] for info in manifest["files"].values())
    print(f"OK {path}: step {manifest['step']}, {len(manifest['files'])} files, {format_bytes(total)}, "
          f"{checked} match the manifest")
    return 0


def _export(args: argparse.Namespace) -> int:
    given = args.path.rstrip("/")
    path = reader.resolve_checkpoint(given)  # a run folder or a checkpoints folder: its newest complete checkpoint
    summary = reader.export_model(path, args.to)
    chosen = "" if str(path) == given else f", the newest complete checkpoint in {given}"
    print(f"wrote {args.to}: {summary['tensors']} tensors, {format_bytes(summary['bytes'])}, "
          f"{'/'.join(summary['dtypes'])}, from step {summary['step']} ({path}{chosen})")
    return 0
