"""DCP's async-save staging for the checkpointer: the copy to CPU the training stalls for, minus the JSON blobs."""

from __future__ import annotations

from typing import Any

import torch.distributed.checkpoint as dcp

from meshrun.ckpt.state import is_blob_key


class StagingWriter(dcp.FileSystemWriter):
    """FileSystemWriter whose async staging (the copy the training stalls for) is DCP's own, minus the JSON blobs.

    With CUDA, DCP keeps its pinned staging buffers between saves (``cache_staged_state_dict``); their layout is
    fixed by the first save, so the blobs, fresh CPU tensors already that may change length from save to save, are
    left out of the copy. Should the layout change all the same, the cache is dropped and built again. On an object
    store the same class writes through the store's fsspec instance (``ObjectStore.dcp_writer`` binds it).
    """

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        bulk, blobs = _split_blobs(state_dict)
        try:
            staged = super().stage(bulk)
        except (RuntimeError, KeyError, ValueError, TypeError):
            if getattr(self, "state_dict_cache", None) is None:
                raise
            self.state_dict_cache = None  # the state's layout changed since the cache was built
            staged = super().stage(bulk)
        return _merge(staged, blobs)


def _split_blobs(tree: dict[str, Any], prefix: str = "") -> tuple[dict[str, Any], dict[str, Any]]:
    bulk: dict[str, Any] = {}
    blobs: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            bulk[key], blobs[key] = _split_blobs(value, dotted + ".")
        elif is_blob_key(dotted):
            blobs[key] = value
        else:
            bulk[key] = value
    return bulk, blobs


def _merge(staged: dict[str, Any], blobs: dict[str, Any]) -> dict[str, Any]:
    """A new nested dict: staged entries plus blobs (the staging cache itself is not modified)."""
    out = dict(staged)
    for key, value in blobs.items():
        out[key] = _merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out
