"""Session.prepare_model on a model that is not the built-in GPT (tests/mlp_lm.py): every layout trains exactly
like one process (CPU, gloo, fp32), and a user-script checkpoint moves across world sizes.

Each layout trains MLPLM (3 blocks, dim 32) for 6 AdamW steps (lr 1e-2) on a global batch of 8 random sequences
of 16 tokens, from the weights a single process builds with the same seed. Tolerances are those of the GPT
layout tests (tests/test_parallel_layouts.py): loss per step atol 1e-5, every final parameter atol 1e-4 (one
AdamW step moves a parameter by up to 1e-2, so a missing gradient sync or a wrong shard is far outside).

The same runs train MLPLM with its head tied to the token embedding (``tied=True``) under DDP, FSDP2, HSDP on
one node (FSDP2, said in the start-up note), TP 2 (head and embedding replicated, or both split by vocabulary
rows) on 2 ranks and HSDP 2 x 2 and TP 2 x FSDP 2 on 4 ranks: the tie holds (one parameter under both names) and
both names match the one-process weights; a TP plan placing the two halves differently is refused.

Layouts: FSDP2 and TP 2 on 2 ranks (DDP: tests/test_examples.py); HSDP (2 replicas x 2 shards) and TP 2 x FSDP 2 on 4 ranks. The 2-rank
spawn then saves a checkpoint with FSDP2 at step 3 through ``session.save`` (StepBatches data position, RNG,
optimizer); it is resumed at 1 rank (this process) and at 3 ranks, which must continue with exactly the samples
that follow (none repeated or skipped) and, at the same layout, bitwise-equal weights.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.data import Dataset

from dist_utils import run_distributed
from mlp_lm import MLPLM

STEPS, GLOBAL_BATCH, SEQ, VOCAB = 6, 8, 16, 64
LOSS_ATOL, PARAM_ATOL = 1e-5, 1e-4
pytestmark = pytest.mark.timeout(300)


def step_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(500 + step % 2))
    return tokens[:, :-1], tokens[:, 1:]


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter under every name (a tied weight under both), gathered whole."""
    model = getattr(model, "module", model)
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters(remove_duplicate=False)}


def tied_lm() -> MLPLM:
    """MLPLM whose output head shares the token embedding's (vocab, dim) weight."""
    return MLPLM(tied=True)


# the embedding and the head split by vocabulary rows (both Shard(0)): one DTensor can serve both
VOCAB_PLAN = {**MLPLM.tp_plan, "embed": "embedding_rowwise", "head": "colwise_rep"}


def train(session, model, *, steps: int = STEPS) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    losses = []
    for step in range(steps):
        inputs, targets = step_batch(step)
        share = GLOBAL_BATCH // session.dp_size
        mine = slice(session.dp_rank * share, (session.dp_rank + 1) * share)
        logits = model(inputs[mine])  # (B/dp, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1), targets[mine].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sums = session.sum_metrics(loss_sum=loss.detach() * targets[mine].numel(), tokens=targets[mine].numel())
        losses.append(sums["loss_sum"] / sums["tokens"])
    return losses


def reference(build=MLPLM) -> tuple[list[float], dict[str, torch.Tensor]]:
    from meshrun import Session

    session = Session(seed=0)
    model = session.prepare_model(build(), layout="none")
    return train(session, model), full_params(model)


def run_layouts(rank: int, world_size: int, layouts: list[tuple[str, dict]], ckpt_dir: str | None) -> dict:
    """Train each (label, prepare_model kwargs); the label is the layout, or 'layout/what' (kwargs 'model' builds
    the model). Records (losses, parameters), and for tied models whether both names still hold one parameter,
    the layout's start-up note, or the ConfigError of a refused layout."""
    from meshrun import Session
    from meshrun.config import ConfigError

    out = {}
    for label, kwargs in layouts:
        kwargs = dict(kwargs)
        build = kwargs.pop("model", MLPLM)
        session = Session(seed=0)  # the group is up already: the same Session, a new layout
        try:
            model = session.prepare_model(build(), layout=label.split("/")[0], **kwargs)
        except ConfigError as exc:  # every rank refuses at the same point
            out[label] = f"ConfigError: {exc}"
            continue
        module = session.layout.module
        out[label] = (train(session, model), full_params(model))
        out[label + ":tied"] = module.head.weight is module.embed.weight
        out[label + ":note"] = session.layout.note
    if ckpt_dir:
        out["ckpt"] = save_fsdp(ckpt_dir)
    return out


# ---- checkpoints ---------------------------------------------------------------------------------------------------

class Numbered(Dataset):
    """Sample i is (i, i): the data position is visible in the batches."""

    def __len__(self) -> int:
        return 60

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor([i]), torch.tensor([i])


def seen_samples(session, batches, steps: int) -> list[int]:
    """Global sample ids of the next ``steps`` steps, gathered from every rank (sorted per step)."""
    import torch.distributed as dist

    seen = []
    for _ in range(steps):
        ids = torch.cat([x.flatten() for x, _ in batches.next_step()])
        if dist.is_initialized():
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, ids.tolist())
            seen.append(sorted(i for part in parts for i in part))
        else:
            seen.append(sorted(ids.tolist()))
    return seen


def save_fsdp(ckpt_dir: str) -> dict:
    from meshrun import Session

    session = Session(seed=3, checkpoint=ckpt_dir)
    model = session.prepare_model(MLPLM(), layout="fsdp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = session.step_batches(Numbered(), micro_batch=3, global_batch=6)
    before = seen_samples(session, batches, 3)
    train(session, model, steps=2)
    session.save(3, model=model, optimizer=optimizer, batches=batches, extra={"best": 1.5})
    weights = full_params(model)
    after = seen_samples(session, batches, 2)
    # the same layout, resumed into a fresh model: every weight bit for bit
    fresh = session.prepare_model(MLPLM(vocab=VOCAB, layers=3), layout="fsdp")
    extra: dict[str, float] = {}
    again = session.step_batches(Numbered(), micro_batch=3, global_batch=6)
    step = session.resume(model=fresh, optimizer=torch.optim.AdamW(fresh.parameters(), lr=1e-2),
                          batches=again, extra=extra)
    same = all(torch.equal(weights[n], p) for n, p in full_params(fresh).items())
    session.close()
    return {"before": before, "after": after, "resumed_step": step, "bitwise": same, "extra": extra, "weights": weights}


def resume_at(rank: int, world_size: int, ckpt_dir: str, micro_batch: int) -> dict:
    from meshrun import Session

    session = Session(seed=3, checkpoint=ckpt_dir)
    model = session.prepare_model(MLPLM(), layout="fsdp")
    batches = session.step_batches(Numbered(), micro_batch=micro_batch, global_batch=6)
    step = session.resume(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), batches=batches)
    return {"step": step, "after": seen_samples(session, batches, 2), "weights": full_params(model)}


# ---- the tests -----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.fixture(scope="module")
def tied_ref():
    return reference(tied_lm)


TIED_TWO_RANKS = [("ddp/tied", {}), ("fsdp/tied", {}), ("hsdp/tied", {}), ("tp/tied", {}),
                  ("tp/tied-vocab", {"tp_plan": VOCAB_PLAN}),
                  ("tp/tied-mixed", {"tp_plan": {**MLPLM.tp_plan, "head": "colwise_rep"}})]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("session_ckpt"))
    # DDP for a user's model is covered by tests/test_examples.py
    layouts = [("fsdp", {}), ("tp", {})] + [(label, {**kw, "model": tied_lm}) for label, kw in TIED_TWO_RANKS]
    return run_distributed(run_layouts, 2, layouts, ckpt, init_pg=False, threads=1)[0], ckpt


@pytest.fixture(scope="module")
def four_ranks():
    layouts = [("hsdp", {"dp_replicate": 2}), ("tp+fsdp", {"tp": 2}),
               ("hsdp/tied", {"dp_replicate": 2, "model": tied_lm}), ("tp+fsdp/tied", {"tp": 2, "model": tied_lm})]
    return run_distributed(run_layouts, 4, layouts, None, init_pg=False, threads=1)[0]


def assert_matches(result, ref) -> None:
    losses, params = result
    ref_losses, ref_params = ref
    assert losses == pytest.approx(ref_losses, abs=LOSS_ATOL)
    assert ref_losses[-1] < ref_losses[0] - 0.05  # it trained: a no-op layout would not get here
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value, atol=PARAM_ATOL, rtol=0, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_two_rank_layout_matches_one_process(two_ranks, ref, layout):
    assert_matches(two_ranks[0][layout], ref)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["hsdp", "tp+fsdp"])
def test_four_rank_layout_matches_one_process(four_ranks, ref, layout):
    assert_matches(four_ranks[layout], ref)


@pytest.mark.slow
@pytest.mark.parametrize("label", ["ddp/tied", "fsdp/tied", "hsdp/tied", "tp/tied", "tp/tied-vocab"])
def test_tied_model_trains_like_one_process_at_two_ranks(two_ranks, tied_ref, label):
    """The head and the embedding stay one parameter (so both names hold the one-process weights), whether TP
    replicates both (tp/tied) or splits both by vocabulary rows (tp/tied-vocab)."""
    result = two_ranks[0]
    assert_matches(result[label], tied_ref)
    assert result[label + ":tied"]
    torch.testing.assert_close(result[label][1]["head.weight"], result[label][1]["embed.weight"], atol=0, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("label", ["hsdp/tied", "tp+fsdp/tied"])
def test_tied_model_trains_like_one_process_at_four_ranks(four_ranks, tied_ref, label):
    assert_matches(four_ranks[label], tied_ref)
    assert four_ranks[label + ":tied"]


@pytest.mark.slow
def test_tp_refuses_a_tie_whose_halves_it_places_differently(two_ranks):
    """The plan splits the head by vocabulary rows but replicates the embedding: one line names both."""
    message = two_ranks[0]["tp/tied-mixed"]
    assert message.startswith("ConfigError: layout='tp': embed.weight and head.weight are one tied parameter")
    assert "Replicate" in message and "Shard(dim=0)" in message and "embedding_rowwise" in message
    assert "\n" not in message


@pytest.mark.slow
def test_hsdp_on_one_node_says_it_runs_fsdp(two_ranks, four_ranks):
    assert two_ranks[0]["hsdp/tied:note"].startswith("layout='hsdp' on one node runs plain FSDP over 2 ranks")
    assert four_ranks["hsdp:note"] == ""  # 2 replicas x 2 shards: HSDP as named


@pytest.mark.slow
def test_fsdp_checkpoint_resumes_bitwise_at_the_same_layout(two_ranks):
    saved = two_ranks[0]["ckpt"]
    assert saved["resumed_step"] == 3 and saved["bitwise"] and saved["extra"] == {"best": 1.5}


@pytest.mark.slow
@pytest.mark.parametrize("world_size,micro_batch", [(1, 6), (3, 2)])
def test_fsdp_checkpoint_resumes_at_another_world_size(two_ranks, world_size, micro_batch):
    saved, ckpt = two_ranks[0]["ckpt"], two_ranks[1]
    if world_size == 1:
        resumed = resume_at(0, 1, ckpt, micro_batch)
    else:
        resumed = run_distributed(resume_at, world_size, ckpt, micro_batch, init_pg=False, threads=1)[0]
    assert resumed["step"] == 3
    # the same next samples as the 2-rank run saw after saving; none of them was seen before the save
    assert resumed["after"] == saved["after"]
    assert not {i for b in saved["before"] for i in b} & {i for b in resumed["after"] for i in b}
    assert all(len(b) == 6 for b in resumed["after"])
    for name, value in saved["weights"].items():
        assert torch.equal(resumed["weights"][name], value), name


@pytest.mark.slow
def test_meshrun_ckpt_verifies_and_exports_a_session_checkpoint(two_ranks, tmp_path):
    from safetensors.torch import load_file

    from meshrun.ckpt.cli import main as ckpt_main

    saved, ckpt = two_ranks[0]["ckpt"], two_ranks[1]
    step = f"{ckpt}/step_0000003"
    assert ckpt_main(["verify", step]) == 0
    assert ckpt_main(["export", step, "--to", str(tmp_path / "model.safetensors")]) == 0
    exported = load_file(str(tmp_path / "model.safetensors"))
    assert set(exported) == set(saved["weights"])
    for name, value in saved["weights"].items():
        assert torch.equal(exported[name], value), name
