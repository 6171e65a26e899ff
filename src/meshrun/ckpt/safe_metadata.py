"""Read DCP's ``.metadata`` without letting it run code.

DCP stores its metadata as a pickle, and ``pickle.load`` calls whatever callable the file names: whoever can write
a checkpoint folder (and recompute its manifest) could run code in ``ckpt export`` and in every resuming rank.
Here the file is unpickled with ``find_class`` restricted to what DCP's metadata is made of, measured by listing
the globals that real saves reference: the dataclasses of ``torch.distributed.checkpoint.metadata``, DCP's
``_StorageInfo``, ``torch.Size``, torch dtypes and layouts, and ``pathlib`` paths. Anything else is refused with an
error whose first line names the file and the global. Plain containers (dict, list, tuple, set) need no global.
"""

from __future__ import annotations

import enum
import os
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata

from meshrun.ckpt.errors import CheckpointError

METADATA_FILE = ".metadata"

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
# Names DCP's pickled .metadata refers to (some private to torch): matched as text, never called by meshrun.
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # maps a layout's name to torch's own layout object
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint._storage_info", "_StorageInfo"),  # where a later torch may move it
    ("pathlib", "Path"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("pathlib._local", "PosixPath"), ("pathlib._local", "PurePosixPath"),  # Python 3.13's module for them
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals DCP's metadata uses (data classes and constants, no calls
    with side effects)."""

    def __init__(self, handle: Any, path: Path):
        super().__init__(handle)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or _is_metadata_type(module, name) or _is_torch_constant(module, name):
            return super().find_class(module, name)
        raise CheckpointError(
            f"{self.path}: refers to the global {module}.{name}, which DCP metadata never uses; refusing to unpickle "
            "it (the checkpoint is crafted, or from a torch whose metadata meshrun does not know yet)")


def _is_metadata_type(module: str, name: str) -> bool:
    """A dataclass or enum defined in DCP's metadata module (rebuilt field by field, no constructor code)."""
    if module != _METADATA_MODULE:
        return False
    obj = getattr(dcp_metadata, name, None)
    return isinstance(obj, type) and (hasattr(obj, "__dataclass_fields__") or issubclass(obj, enum.Enum))


def _is_torch_constant(module: str, name: str) -> bool:
    """torch.float32 and the like: dtypes, layouts and memory formats pickle as a reference to the constant."""
    return module == "torch" and isinstance(getattr(torch, name, None),
                                            (torch.dtype, torch.layout, torch.memory_format))


def load_metadata(path: Path | str) -> Any:
    """DCP's Metadata from the pickle at ``path`` (a path or URL); CheckpointError naming the file when it is
    refused or damaged."""
    from meshrun.ckpt.storage import store_for

    try:
        with store_for(path).open_read(os.fspath(path)) as handle:
            metadata = _MetadataUnpickler(handle, path).load()
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; the checkpoint was not finished or was damaged") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: not readable DCP metadata (truncated or damaged?): "
                              f"{type(exc).__name__}: {exc}") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class SafeMetadataMixin:
    """``read_metadata`` of a DCP file-system reader (local or fsspec) going through :func:`load_metadata`.

    DCP calls ``read_metadata`` itself inside ``dcp.load``, so overriding it covers every read. The rest mirrors
    torch's own method (2.8 to 2.13): the optional ``rank`` names a per-rank ``__<rank>.metadata``, and the load id
    is stamped on ``storage_meta``.
    """

    path: Any

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from meshrun.ckpt.storage import store_for

        rank = kwargs.get("rank")
        name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
        location = os.fspath(self.path)
        metadata = load_metadata(store_for(location).join(location, name))
        if getattr(metadata, "storage_meta", None) is None and hasattr(dcp_metadata, "StorageMeta"):
            metadata.storage_meta = dcp_metadata.StorageMeta()
        if getattr(metadata, "storage_meta", None) is not None and hasattr(self, "load_id"):
            metadata.storage_meta.load_id = self.load_id  # type: ignore[attr-defined] - set by DCP's reader
        return metadata


class SafeFileSystemReader(SafeMetadataMixin, dcp.FileSystemReader):
    """DCP's FileSystemReader (a local folder), with ``.metadata`` read by the restricted unpickler."""
