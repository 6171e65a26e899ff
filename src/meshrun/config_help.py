"""The job config's options as text: ``meshrun train --help``, docs/config.md and the suggestion for a wrong key.

Every option is described once, by the one-line docstring under its field in :mod:`meshrun.config` (the shape
fields of ``[model]`` in :mod:`meshrun.models.shape`). Python keeps no docstring of a dataclass field at run time,
so :func:`sections` reads them from the classes' source with :mod:`ast`; defaults and choices come from the
dataclasses themselves.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import shutil
import textwrap
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal, get_args, get_origin, get_type_hints

from meshrun.config import JobConfig

ELSEWHERE: dict[str, str] = {
    "learning_rate": "train.lr", "lr_min": "train.min_lr", "max_steps": "train.steps", "num_steps": "train.steps",
    "iterations": "train.steps", "max_iters": "train.steps", "batch_size": "train.micro_batch",
    "per_device_train_batch_size": "train.micro_batch", "gradient_accumulation_steps": "train.grad_accum",
    "accumulate_grad_batches": "train.grad_accum", "warmup": "train.warmup_steps",
    "max_grad_norm": "train.grad_clip", "gradient_clip_val": "train.grad_clip", "precision": "train.dtype",
    "mixed_precision": "train.dtype", "block_size": "model.seq_len", "n_embd": "model.dim", "hidden_size": "model.dim",
    "n_layer": "model.n_layers", "num_hidden_layers": "model.n_layers", "n_head": "model.n_heads",
    "num_attention_heads": "model.n_heads", "output_dir": "run.dir", "save_steps": "checkpoint.interval_steps",
    "save_total_limit": "checkpoint.keep_last", "eval_interval": "train.eval_every", "log_interval": "train.log_every",
    "tensor_parallel": "parallel.tp", "pipeline_parallel": "parallel.pp",
    # parallel degrees as torchtitan, Megatron-LM, DeepSpeed and Accelerate name them
    "fsdp": "parallel.dp_shard", "fsdp_size": "parallel.dp_shard", "zero": "parallel.dp_shard",
    "ddp": "parallel.dp_replicate", "hsdp": "parallel.dp_replicate",
    "data_parallel_shard_degree": "parallel.dp_shard", "data_parallel_replicate_degree": "parallel.dp_replicate",
    "tensor_parallel_degree": "parallel.tp", "tensor_model_parallel_size": "parallel.tp", "tp_size": "parallel.tp",
    "pipeline_parallel_degree": "parallel.pp", "pipeline_model_parallel_size": "parallel.pp", "pp_size": "parallel.pp",
    "context_parallel": "parallel.cp", "context_parallel_degree": "parallel.cp", "context_parallel_size": "parallel.cp",
    "cp_size": "parallel.cp", "gradient_checkpointing": "parallel.activation_checkpoint",
    "activation_checkpointing": "parallel.activation_checkpoint", "recompute_granularity": "parallel.activation_checkpoint",
    "num_microbatches": "parallel.pp_microbatches", "n_microbatches": "parallel.pp_microbatches",
    "dataset": "data.source", "data_path": "data.source", "data_dir": "data.source", "train_file": "data.source",
    "dataset_path": "data.source", "data.path": "data.source", "data.dir": "data.source", "data.files": "data.source",
    "checkpoint.path": "checkpoint.dir", "checkpoint.save_dir": "checkpoint.dir", "checkpoint.folder": "checkpoint.dir",
}
"""Names other training tools (Hugging Face Trainer, Lightning, nanoGPT, torchtitan, Megatron-LM, DeepSpeed) give an
option, and meshrun's name."""


HELP_COLUMN = 36
"""Where an option's description starts in ``meshrun train --help``."""


@dataclass(frozen=True)
class Option:
    name: str
    """'section.key'."""
    default: Any
    doc: str
    """The field's docstring, on one line."""
    choices: tuple[str, ...] = ()
    """The allowed values of a choice-valued option."""


@dataclass(frozen=True)
class Section:
    name: str
    doc: str
    """The section class's docstring."""
    options: tuple[Option, ...]


@cache
def sections() -> tuple[Section, ...]:
    """Every section of the job config with its options, in the order of the dataclasses."""
    found = []
    for section, cls in get_type_hints(JobConfig).items():
        docs = _field_docs(cls)
        hints = get_type_hints(cls)
        options = [Option(name=f"{section}.{name}", default=_default(cls, name), doc=docs.get(name, ""),
                          choices=_choices(hints[name])) for name in _field_order(cls)]
        found.append(Section(section, inspect.getdoc(cls) or "", tuple(options)))
    return tuple(found)


def option_names() -> list[str]:
    return [option.name for section in sections() for option in section.options]


def suggest(dotted: str) -> str:
    """' (did you mean 'train.lr'?)' for a wrong option, looking across sections; '' when nothing is close.

    In order: the same key in another section (train.dp_shard), another tool's name for an option
    (train.learning_rate, data.path), a close spelling of the whole name (trian.stpes), a close key in any section."""
    names = option_names()
    key = dotted.partition(".")[2] or dotted
    by_key: dict[str, str] = {}
    for name in names:
        by_key.setdefault(name.partition(".")[2], name)
    best = by_key.get(key) or ELSEWHERE.get(dotted.lower()) or ELSEWHERE.get(key.lower())
    if best is None:
        close = difflib.get_close_matches(dotted, names, n=1) or [
            by_key[k] for k in difflib.get_close_matches(key, list(by_key), n=1)]
        best = close[0] if close else None
    return f" (did you mean '{best}'?)" if best and best != dotted else ""


def options_help(width: int | None = None) -> str:
    """Every option, grouped by section, for ``meshrun train --help``: ``--section.key=DEFAULT`` and its docstring."""
    width = width or max(80, min(120, shutil.get_terminal_size().columns))
    lines = ["config options (--section.key=value, or in a [section] table of --config; the default is shown):"]
    for section in sections():
        lines += ["", f"[{section.name}] {section.doc.split(chr(10) + chr(10))[0].replace(chr(10), ' ')}"]
        for option in section.options:
            flag = f"  --{option.name}={_shown(option.default)}"
            text = option.doc + (f" One of: {', '.join(option.choices)}." if option.choices else "")
            wrapped = textwrap.wrap(text, width=width - HELP_COLUMN)
            if len(flag) + 2 > HELP_COLUMN:  # as argparse does: a long flag on its own line
                lines.append(flag)
            else:
                wrapped[0] = flag.ljust(HELP_COLUMN) + wrapped[0]
                lines.append(wrapped.pop(0))
            lines += [" " * HELP_COLUMN + line for line in wrapped]
    return "\n".join(lines)


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return '""' if value == "" else str(value)


def _default(cls: type, name: str) -> Any:
    return getattr(cls(), name)  # every config dataclass builds with its defaults


def _choices(hint: Any) -> tuple[str, ...]:
    return tuple(get_args(hint)) if get_origin(hint) is Literal else ()


def _field_order(cls: type) -> list[str]:
    """The class's own fields first, then those of its bases ([model]: arch and name, then the shape)."""
    own = [name for name in cls.__dict__.get("__annotations__", {}) if not name.startswith("_")]
    return own + [f.name for f in dataclasses.fields(cls) if f.name not in own]


def _field_docs(cls: type) -> dict[str, str]:
    """{field: its docstring on one line} of ``cls`` and its dataclass bases, read from their source."""
    docs: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        try:
            source = inspect.getsource(klass)
        except OSError:  # installed without its .py files: the options are still listed, with their defaults
            continue
        body = ast.parse(textwrap.dedent(source)).body[0].body  # type: ignore[attr-defined]  # a ClassDef
        for item, after in zip(body, body[1:]):
            if (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
                docs[item.target.id] = " ".join(after.value.value.split())
    return docs
