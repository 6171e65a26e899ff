"""Sharded checkpoints: torch.distributed.checkpoint underneath, with a manifest, a COMPLETE marker written
last, atomic publication, verified resume, async save, retention and the ``meshrun ckpt`` commands.

See docs/checkpoints.md. The trainer uses :class:`Checkpointer` and the helpers of :mod:`meshrun.ckpt.state`.
"""

import warnings

# DCP warns on every save/load without a process group; a single-process run is a normal case here.
warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled, )?unavailable or uninitialized",
                        category=UserWarning)
