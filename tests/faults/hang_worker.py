"""meshrun's trainer with one fault injected: rank 1 stops inside the model's forward at its 4th call (step 4 with
one micro-batch) and never returns, as a rank stuck in a kernel or a data-dependent loop would. Used by
tests/faults/test_hang.py through `meshrun launch`."""

import os
import sys
import time

from meshrun.models import gpt

HANG_AT_CALL = 4
_forward = gpt.GPT.forward
_calls = [0]


def forward(self, *args, **kwargs):
    _calls[0] += 1
    if os.environ.get("RANK") == "1" and _calls[0] == HANG_AT_CALL:
        time.sleep(3600)  # stuck, outside any collective
    return _forward(self, *args, **kwargs)


gpt.GPT.forward = forward

from meshrun.train.cli import main  # noqa: E402 - after the patch, as a fault injector must

sys.exit(main(sys.argv[1:]))
