"""Token corpora: the embedded default (the Python standard library's source, byte-level), a user's text file or
folder (bytes as tokens), or a pre-tokenized uint16/uint32 token file (memory-mapped).

Every corpus has a deterministic train/validation split and a fingerprint (sha256 of what was read), recorded in
the run folder so two nodes, or a resumed run, can tell whether they trained on the same data.
"""

from __future__ import annotations

import hashlib
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshrun.config import ConfigError, DataConfig
from meshrun.units import format_bytes

TOKEN_SUFFIXES = {".bin", ".npy", ".tokens"}
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass
class Corpus:
    train: np.ndarray
    """Training tokens, a flat integer array (possibly a memmap)."""
    val: np.ndarray
    """Validation tokens."""
    fingerprint: str
    """sha256 over the names and bytes that were read."""
    description: str
    """One line for the start-up block."""
    vocab_size: int
    """Smallest vocabulary that holds every token (256 for byte-level text)."""


def load_corpus(cfg: DataConfig) -> Corpus:
    """Load the corpus ``cfg.source`` names; raise ConfigError naming data.source if it is missing."""
    if cfg.source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        return _text_corpus(_text_files(root, "*.py"), root, cfg, f"Python {_py_version()} standard library")
    path = Path(cfg.source).expanduser()
    if not path.exists():
        raise ConfigError(f"data.source={cfg.source!r}: no such file or folder; give a text file, a folder of "
                          "text files, a token file (.bin/.npy), or 'stdlib' for the embedded corpus")
    fmt = cfg.format
    if fmt == "auto":
        fmt = "tokens" if path.is_file() and path.suffix in TOKEN_SUFFIXES else "text"
    if fmt == "tokens":
        return _token_corpus(path, cfg)
    files = [path] if path.is_file() else _text_files(path, "*")
    if not files:
        raise ConfigError(f"data.source={cfg.source!r}: the folder holds no files")
    return _text_corpus(files, path if path.is_dir() else path.parent, cfg, f"text from {path}")


def _py_version() -> str:
    import platform

    return platform.python_version()


def _text_files(root: Path, pattern: str) -> list[Path]:
    """Files under ``root`` matching ``pattern``, sorted by relative path; hidden and skipped folders are pruned
    during the walk (site-packages can be many times larger than the standard library)."""
    import fnmatch
    import os

    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.startswith(".")]
        files += [Path(folder, n) for n in names if not n.startswith(".") and fnmatch.fnmatch(n, pattern)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _is_val(relpath: str, fraction: float) -> bool:
    # Split by file, keyed on the path, so the split does not move when files are added elsewhere.
    return (zlib.crc32(relpath.encode()) % 10_000) < fraction * 10_000


def _text_corpus(files: list[Path], root: Path, cfg: DataConfig, what: str) -> Corpus:
    digest = hashlib.sha256()
    train, val, total = [], [], 0
    for file in files:
        rel = file.relative_to(root).as_posix()
        data = file.read_bytes()
        if cfg.max_bytes and total + len(data) > cfg.max_bytes:
            data = data[: cfg.max_bytes - total]
        digest.update(rel.encode() + b"\0" + data)
        (val if _is_val(rel, cfg.val_fraction) else train).append(data)
        total += len(data)
        if cfg.max_bytes and total >= cfg.max_bytes:
            break
    if len(files) == 1 or not val:  # one file (or an unlucky split): hold out the tail instead
        joined = b"".join(train + val)
        cut = len(joined) - int(len(joined) * cfg.val_fraction)
        train, val = [joined[:cut]], [joined[cut:]]
    train_tokens = np.frombuffer(b"".join(train), dtype=np.uint8)
    val_tokens = np.frombuffer(b"".join(val), dtype=np.uint8)
    desc = f"{what}: {len(files)} files, {format_bytes(total)}, {len(train_tokens):,} train / {len(val_tokens):,} val tokens"
    return Corpus(train=train_tokens, val=val_tokens, fingerprint=digest.hexdigest(), description=desc, vocab_size=256)


def _token_corpus(path: Path, cfg: DataConfig) -> Corpus:
    if path.suffix == ".npy":
        tokens = np.load(path, mmap_mode="r")
    else:
        size, width = path.stat().st_size, np.dtype(cfg.token_dtype).itemsize
        if size % width:
            raise ConfigError(f"data.source={str(path)!r}: {size:,} bytes is not a whole number of "
                              f"data.token_dtype={cfg.token_dtype} tokens ({width} bytes each); set data.token_dtype "
                              "to the dtype the file was written with, or the file is truncated")
        tokens = np.memmap(path, dtype=np.dtype(cfg.token_dtype), mode="r")
    if tokens.ndim != 1 or tokens.dtype.kind not in "ui":
        raise ConfigError(f"data.source={str(path)!r}: expected a flat integer token array, got "
                          f"{tokens.dtype} with shape {tokens.shape}")
    cut = len(tokens) - int(len(tokens) * cfg.val_fraction)
    digest = hashlib.sha256(f"{path.name}:{tokens.dtype}:{len(tokens)}".encode())
    # Hash a strided sample: a full pass over a 100 GB token file at every start would be too slow.
    sample = np.ascontiguousarray(tokens[:: max(1, len(tokens) // 1_000_000)])
    digest.update(sample.tobytes())
    vocab = int(sample.max()) + 1 if len(sample) else 1  # from the sample too; the batcher checks every batch
    desc = f"tokens from {path} ({tokens.dtype}): {cut:,} train / {len(tokens) - cut:,} val tokens"
    return Corpus(train=tokens[:cut], val=tokens[cut:], fingerprint=digest.hexdigest(), description=desc,
                  vocab_size=vocab)
