"""meshrun plan: reference layouts (4x8, 8x8x4x2, a 64-GPU DP 8 x TP 4 x PP 2), clear errors for bad layouts, and
the dry run on a fake 512-rank mesh."""

from __future__ import annotations

import json

import pytest
import torch

from meshrun import planner
from meshrun.comm.mesh import choose_data_parallel
from meshrun.config import ParallelConfig, load_config
from meshrun.models.gpt import GPT
from meshrun.parallel.dryrun import dry_run
from meshrun.parallel.pipeline import bubble_fraction


def make_plan(*argv: str) -> planner.Plan:
    args = planner.parse_args(list(argv))
    return planner.build_plan(planner.job_from_args(args), nodes=args.nodes, gpus_per_node=args.gpus_per_node)


def run_json(capsys, *argv: str) -> dict:
    assert planner.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_global_batch_of_4_nodes_of_8():
    plan = make_plan("--nodes", "4", "--gpus-per-node", "8", "--micro-batch", "8", "--grad-accum", "2")
    assert plan.world_size == 32 and plan.dims.dp_size == 32
    assert plan.batch.global_batch == 512
    assert planner.batch_formula(plan) == "B_global = B_local 8 x G 8 x N 4 x A 2 = 512"
    assert make_plan("--nodes", "4", "--micro-batch", "8", "--global-batch", "512").batch.grad_accum == 2


def test_64_gpu_dp8_tp4_pp2_groups(capsys):
    out = run_json(capsys, "--nodes", "8", "--gpus-per-node", "8", "--dp-replicate", "8", "--tp", "4", "--pp", "2")
    assert out["world_size"] == 64 and len(out["ranks"]) == 64
    rank = out["ranks"][37]
    assert (rank["node"], rank["local_rank"], rank["pp"], rank["dp"], rank["tp"]) == (4, 5, 1, 1, 1)
    assert rank["groups"] == {"tp": [36, 37, 38, 39], "dp": [33, 37, 41, 45, 49, 53, 57, 61], "pp": [5, 37]}
    assert len(out["groups"]["tp"]) == 16 and len(out["groups"]["dp"]) == 8 and len(out["groups"]["pp"]) == 32
    comm = {row["dim"]: row for row in out["communication"]}
    assert not comm["tp"]["crosses_nodes"] and comm["dp_replicate"]["crosses_nodes"] and comm["pp"]["crosses_nodes"]
    assert planner.main(["--nodes", "8", "--dp-replicate", "8", "--tp", "4", "--pp", "2"]) == 0
    text = capsys.readouterr().out
    assert "0,4,..,28" in text and "36-39" in text and "5,37" in text  # readable group members


def test_fsdp_traffic_counts_the_reduction_in_the_dtype_the_trainer_picks():
    """1b on one node of 2 GPUs: FSDP2 by size, its gradients reduce-scattered in bf16 (parallel.grad_reduce_dtype=
    auto), so 2 bytes per parameter where 2 nodes of 1 GPU reduce 4; parameters gathered twice in bf16 either way."""
    one = make_plan("--nodes", "1", "--gpus-per-node", "2", "--model", "1b")
    two = make_plan("--nodes", "2", "--gpus-per-node", "1", "--model", "1b")
    fp32 = planner.build_plan(load_config(None, ["--model.name=1b", "--parallel.grad_reduce_dtype=fp32"]), nodes=1,
                              gpus_per_node=2)
    assert one.reduce_bf16 and not two.reduce_bf16 and not fp32.reduce_bf16
    rows = [{r["dim"]: r for r in plan.comm}["dp_shard"] for plan in (one, two, fp32)]
    assert rows[0]["what"].endswith("reduce-scatter (bf16)") and not rows[1]["what"].endswith("(bf16)")
    assert rows[0]["bytes_per_step"] == pytest.approx(rows[1]["bytes_per_step"] * (2 * 2 + 2) / (2 * 2 + 4))
    assert rows[2]["bytes_per_step"] == pytest.approx(rows[1]["bytes_per_step"])


def test_ddp_traffic_counts_the_linear_layers_bf16_copies_and_the_compression_hook():
    """124m on one node of 2 GPUs: DDP with the linear layers' bf16 copies (train.weight_copies=auto), so their 85M
    gradients travel at 2 bytes and the rest (the tied embedding, the norms) at 4; across 2 nodes (no copies by
    default) all at 4; DDP's bf16 compression hook (parallel.grad_reduce_dtype=bf16) all at 2."""
    one = make_plan("--nodes", "1", "--gpus-per-node", "2", "--model", "124m")
    two = planner.build_plan(load_config(None, ["--model.name=124m", "--parallel.dp_replicate=2"]), nodes=2,
                             gpus_per_node=1)
    hook = planner.build_plan(load_config(None, ["--model.name=124m", "--parallel.grad_reduce_dtype=bf16"]),
                              nodes=1, gpus_per_node=2)
    assert one.weight_copies and not two.weight_copies
    rows = [{r["dim"]: r for r in plan.comm}["dp_replicate"] for plan in (one, two, hook)]
    assert rows[0]["what"] == "gradient all-reduce (linear layers in bf16)" and rows[1]["what"] == "gradient all-reduce"
    mats, _ = one.spec.block_params(one.model)
    linear, total = mats * one.model.n_layers, one.spec.count_params(one.model)
    assert rows[0]["bytes_per_step"] == pytest.approx(rows[1]["bytes_per_step"] * (linear * 2 + (total - linear) * 4)
                                                      / (total * 4))
    assert rows[2]["what"].endswith("(bf16)") and rows[2]["bytes_per_step"] == pytest.approx(rows[1]["bytes_per_step"] / 2)


def test_bubble_of_4_stages_and_32_microbatches(capsys):
    assert bubble_fraction(4, 32) == pytest.approx(0.09375)
    assert bubble_fraction(4, 32, virtual_stages=2) == pytest.approx(3 / 64)
    assert planner.main(["--nodes", "4", "--model", "1b", "--pp", "4", "--tp", "8", "--pp-microbatches", "32",
                         "--micro-batch", "32"]) == 0
    assert "bubble (4 - 1) / 32 = 9.4%" in capsys.readouterr().out


def test_a_large_bubble_gets_advice_that_keeps_micro_batches_large():
    small = make_plan("--nodes", "1", "--gpus-per-node", "4", "--model", "1b", "--pp", "4", "--dp-replicate", "1",
                      "--micro-batch", "8", "--pp-schedule", "1f1b")  # 4 micro-batches of 4096 tokens: bubble 75%
    assert small.dims.pp_microbatches == 4
    assert any(w.startswith("pipeline bubble 75% with 4 micro-batches of 4096 tokens: more samples per step "
                            "(--train.grad_accum)") for w in small.warnings), small.warnings
    large = make_plan("--nodes", "1", "--gpus-per-node", "4", "--model", "1b", "--pp", "4", "--dp-replicate", "1",
                      "--micro-batch", "8", "--pp-microbatches", "4", "--model.seq_len=8192",
                      "--pp-schedule", "1f1b")  # 16384 tokens each
    assert any(w.startswith("pipeline bubble 75%: raise --pp-microbatches (now 4, 16384 tokens each) to 8, the "
                            "default for this batch") for w in large.warnings), large.warnings


def test_tp8_shards_of_a_12288_hidden_96_head_model(capsys):
    out = run_json(capsys, "--nodes", "1", "--hidden", "12288", "--heads", "96", "--ffn", "49152", "--layers", "8",
                   "--tp", "8", "--micro-batch", "1")
    shards = out["tp_shards"]
    assert (shards["heads_per_gpu"], shards["mlp_width"], shards["mlp_width_per_gpu"]) == (12, 49152, 6144)


def test_parameter_counts_match_the_model():
    for argv in (["--model", "124m"], ["--model", "1b", "--pp", "2", "--untied"], ["--model", "small", "--tp", "4"]):
        plan = make_plan("--nodes", "1", *argv)
        with torch.device("meta"):
            model = GPT(plan.model)
        assert sum(row["params_total"] for row in plan.memory) == model.num_params(), argv


def test_sharding_divides_per_gpu_memory():
    ddp = make_plan("--nodes", "1", "--model", "1b", "--parallel.data_parallel=ddp")
    fsdp = make_plan("--nodes", "1", "--model", "1b", "--dp-shard", "8", "--dp-replicate", "1")
    ratio = ddp.memory[0]["bytes"]["optimizer"] / fsdp.memory[0]["bytes"]["optimizer"]
    assert ratio == pytest.approx(8, rel=1e-3)
    full = make_plan("--nodes", "1", "--model", "1b", "--parallel.data_parallel=ddp", "--activation-checkpoint", "full")
    assert full.memory[0]["bytes"]["activations"] < ddp.memory[0]["bytes"]["activations"] / 4


def test_default_1b_plan_runs_fsdp2_as_the_trainer_does_on_gpus(capsys):
    auto = make_plan("--nodes", "1", "--model", "1b")
    ddp = make_plan("--nodes", "1", "--model", "1b", "--data-parallel", "ddp")
    params = auto.spec.count_params(auto.model)
    chosen, note = choose_data_parallel(ParallelConfig(), params=params, on_gpu=True)
    assert (auto.dims.dp_replicate, auto.dims.dp_shard) == (chosen.dp_replicate, 8) == (1, 8)
    assert auto.data_parallel == note and "1.03B parameters >= 1B on GPUs" in note
    assert (ddp.dims.dp_replicate, ddp.dims.dp_shard) == (8, 1) and "DDP, 8 whole replicas" in ddp.data_parallel
    state = [sum(p.memory[0]["bytes"][k] for k in ("params", "grads", "optimizer")) for p in (auto, ddp)]
    mats, norms = auto.spec.block_params(auto.model)
    gathered = 2 * 3 * (mats + norms) * 2  # two units of 3 blocks (parallel.fsdp_unit_blocks=auto), in bf16
    assert state[1] / 8 < state[0] <= state[1] / 8 + gathered  # 16 bytes per parameter over 8 ranks, plus them
    assert auto.memory[0]["total_bytes"] < ddp.memory[0]["total_bytes"] - 12 * 2**30  # same activations
    out = run_json(capsys, "--model", "1b")
    assert out["data_parallel"]["mode"] == "fsdp" and out["parallel"]["dp_shard"] == 8
    assert run_json(capsys, "--model", "124m")["data_parallel"]["mode"] == "ddp"  # 0.12B: below the threshold
    assert "(124M parameters < 1B: parallel.data_parallel=auto shards" in make_plan("--model", "124m").data_parallel
    assert planner.main(["--model", "1b", "--ranks", "1"]) == 0
    assert "data parallelism: FSDP2 over every data-parallel rank (1.03B" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--nodes", "2", "--dp-replicate", "3"], "= 3 does not equal the world size 16"),
    (["--model", "124m", "--tp", "8"], "parallel.tp=8 does not divide model.n_heads=12"),
    (["--model", "tiny", "--pp", "4", "--dp-replicate", "2"], "4 pipeline stages but the model has only model.n_"),
    (["--model", "1b", "--pp", "4", "--pp-microbatches", "2"], "parallel.pp_microbatches=2 is fewer than the 4"),
    (["--nodes", "2", "--tp", "16"], "parallel.tp=16 is larger than the 8 GPUs of one node"),
    (["--micro-batch", "8", "--global-batch", "100"], "train.global_batch=100 is not divisible"),
])
def test_bad_layouts_fail_with_the_option_named(capsys, argv, message):
    assert planner.main(argv) == 2
    assert message in capsys.readouterr().err


def test_tp_across_nodes_is_allowed_with_a_warning():
    plan = make_plan("--nodes", "2", "--tp", "16", "--allow-tp-across-nodes", "--model", "1b")
    assert any(w.startswith("TP groups span 2 nodes") for w in plan.warnings)
    fsdp = make_plan("--nodes", "4", "--dp-shard", "32", "--dp-replicate", "1", "--model", "1b")
    assert any("--dp-shard 8 --dp-replicate -1" in w for w in fsdp.warnings)


def test_big_worlds_truncate_the_rank_table(capsys):
    assert planner.main(["--nodes", "64", "--model", "1b", "--tp", "8", "--pp", "2"]) == 0
    text = capsys.readouterr().out
    assert "ranks (24 of 512 shown; --ranks all for every rank)" in text
    assert planner.main(["--nodes", "64", "--model", "1b", "--tp", "8", "--pp", "2", "--ranks", "all"]) == 0
    assert "│  511 │" in capsys.readouterr().out


def test_dry_run_on_a_fake_512_rank_mesh(capsys):
    argv = ["--nodes", "64", "--model", "1b", "--tp", "8", "--pp", "2", "--dp-shard", "4", "--dp-replicate", "-1",
            "--sequence-parallel", "--dry-run"]
    assert planner.main(argv) == 0
    text = capsys.readouterr().out
    assert "rank 511 (node 63, local 7): pp 1, dp_replicate 7, dp_shard 3, cp 0, tp 7 | PP 1f1b + TP + HSDP" in text
    assert "layers 10-17" in text  # 18 layers over 2 stages, cut by cost: 10 + 8 (the last runs the head)
    w1 = next(line for line in text.splitlines() if "feed_forward.w1.weight" in line)
    assert "5,632 x 2,048" in w1 and "176 x 2,048" in w1  # 5632 rows / tp 8 = 704, / dp_shard 4 = 176


def test_train_dry_run_entry_point(capsys):
    job = load_config(None, ["--model.name=small", "--parallel.tp=4", "--parallel.dp_shard=2",
                             "--parallel.dp_replicate=-1"])
    assert dry_run(job, world_size=64, gpus_per_node=8) == 0
    assert "TP + HSDP" in capsys.readouterr().out
    assert dry_run(job, world_size=6, gpus_per_node=8) == 2
    assert "world size 6 is not divisible" in capsys.readouterr().err


def test_config_options_and_short_flags_give_the_same_plan(capsys, tmp_path):
    dotted = run_json(capsys, "--parallel.tp=2", "--model.name=1b")
    assert dotted == run_json(capsys, "--tp", "2", "--model", "1b")
    assert dotted["parallel"]["tp"] == 2 and dotted["model"]["dim"] == 2048  # not the defaults
    config = tmp_path / "job.toml"
    config.write_text('[model]\nname = "small"\n[parallel]\ntp = 2\n[train]\nmicro_batch = 4\n')
    out = run_json(capsys, "--config", str(config), "--train.micro_batch", "2", "--nodes", "2")
    assert (out["parallel"]["tp"], out["batch"]["micro_batch"], out["batch"]["dp_size"]) == (2, 2, 8)
    assert out == run_json(capsys, "--model", "small", "--tp", "2", "--micro-batch", "2", "--nodes", "2")


@pytest.mark.parametrize("argv, message", [
    (["--parallel.tpp=2"], "unknown config option 'parallel.tpp' (did you mean 'parallel.tp'?)"),
    (["--tp", "2", "--parallel.tp=4"], "--tp and --parallel.tp both set parallel.tp; give only one of them"),
    (["--bogus"], "unexpected argument '--bogus'; options look like --section.key=value (see `meshrun plan"),
    (["--nodse", "2"], "unexpected argument '--nodse' (did you mean --nodes?)"),
    (["--micro_batch=2"], "unexpected argument '--micro_batch=2' (did you mean --micro-batch?)"),
])
def test_bad_options_are_named_as_train_names_them(capsys, argv, message):
    assert planner.main(argv) == 2
    assert message in capsys.readouterr().err


def test_the_time_estimate_names_a_custom_shape_as_such(capsys):
    # Llama-3-8B's shapes over the default model name are not "the 124m size"
    llama = ["--nodes", "4", "--gpus-per-node", "8", "--hidden", "4096", "--layers", "32", "--heads", "32",
             "--kv-heads", "8", "--ffn", "14336", "--vocab", "128256", "--seq", "8192", "--tokens", "1T"]
    assert planner.main(llama) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "N = 7.5e+09 parameters, the custom shape above)" in text and "124m" not in text
    assert planner.main(["--hidden", "1536", "--layers", "4", "--tokens", "1B"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "the custom shape above: dim, n_layers given, the rest from the 124m size)" in text
    assert planner.main(["--model", "350m", "--tokens", "1B"]) == 0
    assert "parameters, the gpt 350m size)" in " ".join(capsys.readouterr().out.split())


def test_weights_cast_once_add_their_bf16_copies_to_each_stage():
    """parallel.pp_cast_once keeps a 2-byte copy of every linear weight: each stage's blocks' matrices, and the
    output head on the last. Its default (auto) keeps them on GPUs, which the planner plans for."""
    common = ("--nodes", "1", "--gpus-per-node", "2", "--model", "1b", "--pp", "2", "--untied")
    plain, once = make_plan(*common, "--parallel.pp_cast_once=false"), make_plan(*common)
    assert once.memory == make_plan(*common, "--parallel.pp_cast_once=true").memory
    mats, _ = plain.spec.block_params(plain.model)
    head = plain.model.vocab_size * plain.model.dim
    for stage, (a, b) in enumerate(zip(plain.memory, once.memory)):
        copies = (len(a["layers"]) * mats + (head if stage == 1 else 0)) * 2
        assert b["bytes"]["params"] - a["bytes"]["params"] == copies, stage


@pytest.mark.parametrize(("overrides", "blocks"), [
    ((), 6),  # two units of 3: the auto size for the 1b model's 51M-parameter blocks
    (("--parallel.fsdp_unit_blocks=1",), 2),
    (("--parallel.fsdp_unit_blocks=-1",), 18),  # the whole model one unit
])
def test_fsdp_working_memory_counts_two_units_as_the_trainer_makes_them(overrides, blocks):
    from meshrun.planner.estimate import gathered_blocks

    plan = make_plan("--nodes", "1", "--model", "1b", *overrides)
    total = plan.spec.count_params(plan.model)
    assert gathered_blocks(plan, 0, total) == blocks
    one = make_plan("--nodes", "1", "--model", "1b", "--parallel.fsdp_unit_blocks=1")
    mats, norms = plan.spec.block_params(plan.model)
    extra = plan.memory[0]["bytes"]["params"] - one.memory[0]["bytes"]["params"]
    assert extra == (blocks - 2) * (mats + norms) * 2  # bf16 copies of the blocks gathered beyond two


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "1T", "--peak-tflops", "0"], "--peak-tflops 0: must be above 0"),
    (["--tokens", "1T", "--peak-tflops", "-5"], "--peak-tflops -5: must be above 0"),
    (["--tokens", "1T", "--tokens-per-s", "-100"], "--tokens-per-s -100: must be above 0"),
    (["--tokens", "1T", "--tokens-per-s", "0"], "--tokens-per-s 0: must be above 0"),
    (["--tokens", "1T", "--from-run", "/nonexistent"], "--from-run /nonexistent: no such folder"),
    (["--tokens", "1T", "--from-run", ".", "--tokens-per-s", "5"], "--from-run and --tokens-per-s both give"),
    (["--from-run", "/nonexistent"], "--from-run only shapes the time estimate; give --tokens too"),
    (["--tokens-per-s", "100", "--mfu", "0.5"], "--mfu, --tokens-per-s only shape the time estimate; give --tokens"),
])
def test_bad_time_estimate_options_are_refused_not_replaced(capsys, argv, message):
    assert planner.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_dtype_auto_is_planned_as_bf16_and_json_writes_the_resolved_kv_heads(capsys):
    out = run_json(capsys, "--model", "1b", "--dtype", "auto")
    assert out["dtype"] == {"train_dtype": "auto", "compute": "bf16"} and out["model"]["n_kv_heads"] == 16
    assert out["memory"] == run_json(capsys, "--model", "1b", "--dtype", "bf16")["memory"]
    assert planner.main(["--model", "1b", "--dtype", "auto", "--ranks", "1"]) == 0
    assert "compute dtype: bf16 (train.dtype=auto: bf16, as training picks on GPUs" in capsys.readouterr().out


def test_the_doc_shows_the_cuts_plan_prints_for_1b_on_two_stages():
    cut = lambda *argv: list(make_plan("--model", "1b", "--pp", "2", *argv).dims.pp_layers)  # noqa: E731
    assert cut() == [5, 5, 5, 3] and cut("--pp-balance", "blocks") == [5, 5, 4, 4]  # auto: interleaved1f1b
    assert cut("--pp-schedule", "1f1b") == [10, 8] and cut("--pp-schedule", "1f1b", "--pp-balance", "blocks") == [9, 9]
