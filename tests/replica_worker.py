"""`meshrun train` for the replica-group tests, with what the tests need around the real trainer:

- after every committed step, the sha256 of this rank's local weights goes to <run dir>/weights_rank_<r>.jsonl
  (the tests compare groups step by step, bitwise);
- MESHRUN_TEST_STEP_SLEEP=<s> paces steps, and MESHRUN_TEST_ALONE_SLEEP=<s> those a group runs alone (a survivor
  must still be training when its peer has restarted); the digest line says how long the step slept;
- MESHRUN_TEST_KILL=<where>:<step> SIGKILLs this process at a chosen point of step <step> (counted from 1):
  ``forward`` (rank 1, first attempt only, before its forward pass), ``allreduce`` (the other groups are inside
  the cross-group gradient all-reduce, waiting for this group), ``save`` (the checkpoint's shards are on disk,
  its manifest and COMPLETE are not) or ``heal`` (while loading the state a live group sent).

Run as `meshrun launch --nproc-per-node N tests/replica_worker.py <train options>`.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time

import torch

from meshrun.ckpt import checkpointer as checkpointer_module
from meshrun.train import replicas, trainer
from meshrun.train.cli import main

WHERE, _, STEP = os.environ.get("MESHRUN_TEST_KILL", ":0").partition(":")
KILL_STEP = int(STEP or 0)
PACE_S = float(os.environ.get("MESHRUN_TEST_STEP_SLEEP", "0"))
ALONE_S = float(os.environ.get("MESHRUN_TEST_ALONE_SLEEP", "0"))


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def weights_digest(model_parts) -> str:
    digest = hashlib.sha256()
    for part in model_parts:
        for name, tensor in sorted(part.state_dict().items()):
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            digest.update(name.encode())
            digest.update(local.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


train_step = trainer.Trainer.train_step


def paced_train_step(self):
    if WHERE == "forward" and self.step + 1 == KILL_STEP and self.env.rank == 1 and not self.env.restart_count:
        die()  # the launcher's restart path: rank 1 dies once, before its forward pass
    paced = ALONE_S if self.replicas is not None and self.replicas.live_groups == 1 else PACE_S
    time.sleep(paced)
    result = train_step(self)
    if result is not None:
        line = {"step": self.step, "time": time.time(), "paced": paced, "sha": weights_digest(self.engine.model_parts),
                "data": [self.data.position.epoch, self.data.position.consumed]}
        with open(self.run_dir / f"weights_rank_{self.env.rank}.jsonl", "a") as out:
            out.write(json.dumps(line) + "\n")
    return result


trainer.Trainer.train_step = paced_train_step

if WHERE == "allreduce":
    average = replicas.ReplicaGroups.average_gradients

    def average_then_die(self):
        if self.step + 1 == KILL_STEP:
            def allreduce_and_die(tensor, *args, **kwargs):
                time.sleep(0.3)  # the other groups are inside this all-reduce now, waiting for this group's part
                die()

            self.manager.allreduce = allreduce_and_die
        return average(self)

    replicas.ReplicaGroups.average_gradients = average_then_die
elif WHERE == "save":
    write = checkpointer_module.write_durable

    def write_or_die(path, data):  # path: a local path or a URL (the storage seam's location)
        if str(path).endswith("manifest.json") and f"step_{KILL_STEP:07d}" in str(path):
            die()
        write(path, data)

    checkpointer_module.write_durable = write_or_die
elif WHERE == "heal":
    load = replicas.ReplicaGroups._load_peer_state

    def load_and_die(self, state):
        if KILL_STEP:
            die()
        load(self, state)

    replicas.ReplicaGroups._load_peer_state = load_and_die

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
