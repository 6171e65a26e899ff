"""The vocabulary-parallel cross-entropy on local shards (meshrun.parallel.vocab_loss) equals F.cross_entropy on
the whole logits, in value and gradient, eager and compiled (CPU, gloo, 2 ranks, fp32: within 1e-5).

The vocabulary (11) does not divide by the 2 ranks, so the slices are 6 and 5 wide as DTensor's Shard makes them;
some targets are -100 (ignored) and the logits have a large offset (the softmax must be stabilised by the global
maximum). A wrong offset, a missing all-reduce or a missing one-hot term is off by far more.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from dist_utils import each_run, results_of, run_distributed

V, N = 11, 24


def _inputs():
    torch.manual_seed(0)
    logits = torch.randn(2, N // 2, V) * 3 + 40.0
    targets = torch.randint(0, V, (2, N // 2))
    targets[0, :3] = -100
    return logits, targets


def _reference():
    logits, targets = _inputs()
    logits.requires_grad_(True)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    loss.backward()
    return loss.detach(), logits.grad


def _sharded(rank, world_size, compiled):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from meshrun.parallel.engine import loss_function

    mesh = init_device_mesh("cpu", (world_size,))
    logits, targets = _inputs()
    sharded = distribute_tensor(logits, mesh, [Shard(2)]).requires_grad_(True)
    loss = loss_function(compiled, vocab_sharded=True)(sharded, targets)
    # autograd.grad, not .backward(): torch 2.8 files an unevenly sharded leaf's .grad as Replicate
    (grad,) = torch.autograd.grad(loss, sharded)
    assert isinstance(grad, DTensor) and grad.placements == (Shard(2),)
    return loss.detach(), grad.full_tensor()


def _sharded_both(rank, world_size):
    """_sharded eager, then compiled, on the same 2 ranks (starting them took longer than the eager run)."""
    return each_run({compiled: functools.partial(_sharded, rank, world_size, compiled) for compiled in (False, True)})


@pytest.fixture(scope="module")
def sharded() -> list[dict]:
    return run_distributed(_sharded_both, 2, threads=1)


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_local_shards_give_the_whole_cross_entropy_and_its_gradient(compiled, sharded):
    want_loss, want_grad = _reference()
    for loss, grad in results_of(sharded, compiled):  # the same value on every rank
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-5)
    assert want_grad[0, :3].abs().max() == 0  # ignored targets


def test_logits_that_are_not_vocabulary_sharded_take_the_plain_cross_entropy():
    from meshrun.parallel.engine import loss_function

    want_loss, want_grad = _reference()
    logits, targets = _inputs()
    logits.requires_grad_(True)
    loss = loss_function(False, vocab_sharded=True)(logits, targets)  # a TP plan that gathers the logits
    loss.backward()
    torch.testing.assert_close(loss.detach(), want_loss)
    torch.testing.assert_close(logits.grad, want_grad)
