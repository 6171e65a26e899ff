"""Config loading, overrides and the global-batch arithmetic B_global = B_local x G x N x A (pure logic, no process group)."""

import pytest

from meshrun.config import ConfigError, JobConfig, TrainConfig, load_config, resolve_batch


def test_global_batch_is_b_local_x_ranks_x_accumulation():
    # 8 per GPU x 8 GPUs per node x 4 nodes x 2 accumulation steps = 512
    plan = resolve_batch(TrainConfig(micro_batch=8, grad_accum=2), dp_size=8 * 4, seq_len=1024)
    assert plan.global_batch == 512
    assert plan.tokens_per_step == 512 * 1024


def test_global_batch_derives_accumulation_and_keeps_it_across_node_counts():
    train = TrainConfig(micro_batch=8, global_batch=512)
    assert resolve_batch(train, dp_size=32, seq_len=1).grad_accum == 2   # 4 nodes x 8 GPUs
    assert resolve_batch(train, dp_size=16, seq_len=1).grad_accum == 4   # 2 nodes: accumulation doubles
    assert resolve_batch(train, dp_size=64, seq_len=1).grad_accum == 1


def test_non_dividing_global_batch_names_the_numbers():
    with pytest.raises(ConfigError) as info:
        resolve_batch(TrainConfig(micro_batch=8, global_batch=100), dp_size=3, seq_len=1)
    first = str(info.value).splitlines()[0]
    assert "train.global_batch=100" in first and "train.micro_batch=8" in first and "3 data-parallel ranks" in first


def test_contradicting_accumulation_is_refused():
    with pytest.raises(ConfigError, match="train.grad_accum=3 contradicts"):
        resolve_batch(TrainConfig(micro_batch=8, global_batch=64, grad_accum=3), dp_size=2, seq_len=1)


def test_unknown_key_suggests_the_right_one():
    with pytest.raises(ConfigError, match=r"unknown config option 'train.stpes'.*did you mean 'train.steps'"):
        load_config(None, ["--train.stpes=3"])
    with pytest.raises(ConfigError, match="unknown config option 'trian.steps'"):
        load_config(None, ["--trian.steps=3"])


def test_toml_then_overrides_with_types(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[train]\nsteps = 7\nlr = 0.01\n[model]\nname = "small"\n[run]\ntensorboard = true\n')
    job = load_config(path, ["--train.steps=9", "--dist.timeout_s=30", "--train.compile=false"])
    assert (job.train.steps, job.train.lr, job.model.name, job.run.tensorboard) == (9, 0.01, "small", True)
    assert job.dist.timeout_s == 30.0 and job.train.compile == "false"
    # the written TOML round-trips to the same config
    again = tmp_path / "again.toml"
    again.write_text(job.to_toml())
    assert load_config(again).to_dict() == job.to_dict()


def test_print_config_writes_out_the_named_size_and_loads_back(tmp_path, capsys):
    """--print-config prints the [model] shape model.name gives (the values the run builds and writes to its
    config.toml), not the 0s that mean "the named size's"; fed back with --config, it is the same config."""
    import tomllib

    from meshrun.models.gpt import SIZES
    from meshrun.train.cli import main as train_main

    assert train_main(["--print-config", "--model.name=small", "--model.n_layers=3"]) == 0
    text = capsys.readouterr().out
    model = tomllib.loads(text)["model"]
    small = SIZES["small"]
    assert (model["name"], model["dim"], model["n_heads"], model["ffn_dim"]) == ("small", small.dim, small.n_heads,
                                                                                small.hidden_dim)
    assert model["n_layers"] == 3 != small.n_layers and small.dim != 0  # an override wins over the named size
    path = tmp_path / "printed.toml"
    path.write_text(text)
    assert train_main(["--print-config", f"--config={path}"]) == 0
    assert capsys.readouterr().out == text


@pytest.mark.parametrize("override, message", [
    ("--train.steps=abc", "train.steps='abc' is not a valid int"),
    ("--train.compile=maybe", "train.compile='maybe' is not one of auto, true, false"),
    ("--train.fused_optimizer=maybe", "is not a boolean"),
    ("--train.attention=fa4", "train.attention='fa4' is not one of"),
    ("--train.dtype=fp8", "train.dtype='fp8' is not one of auto, fp32, bf16; float8 matmuls .* --train.float8=true"),
    ("--train.dtype=fp16", "train.dtype='fp16' is not one of .*; fp16 needs loss scaling"),
    ("--train.dtype=bfloat16", "train.dtype='bfloat16' is not one of .*; spell it bf16"),
    ("--train.steps=0", "train.steps must be >= 1"),
    ("--health.hang_timeout_s=-1", r"health.hang_timeout_s=-1.0 is out of range: .*or 0 to disable"),
    ("--health.straggler_threshold=0.5", r"health.straggler_threshold=0.5 is out of range: give a ratio of at least 1"),
    ("--health.straggler_threshold=-2", r"health.straggler_threshold=-2.0 is out of range"),
    ("--checkpoint.interval_steps=-1", r"checkpoint.interval_steps=-1 is out of range: give a number of steps, or 0"),
    ("--checkpoint.interval_minutes=-0.5", r"checkpoint.interval_minutes=-0.5 is out of range"),
    ("--checkpoint.keep_every=-1", r"checkpoint.keep_every=-1 is out of range"),
    ("--checkpoint.timeout_s=0", r"checkpoint.timeout_s=0.0 is out of range: give a positive number"),
    ("--model.n_layers=-2", r"model.n_layers=-2 is out of range: .*or 0 to take the named size's"),
    ("--model.norm_eps=0", r"model.norm_eps=0.0 is out of range"),
    ("--model.rope_theta=-1", r"model.rope_theta=-1.0 is out of range"),
    ("--data.max_bytes=-1", r"data.max_bytes=-1 is out of range"),
    ("--train.lr=-0.1", r"train.lr=-0.1 is out of range"),
    ("--train.min_lr=-1e-5", r"train.min_lr=-1e-05 is out of range"),
    ("--train.warmup_steps=-1", r"train.warmup_steps=-1 is out of range"),
    ("--train.weight_decay=-0.1", r"train.weight_decay=-0.1 is out of range"),
    ("--train.beta1=1", r"train.beta1=1.0 is out of range: AdamW's betas must be in \[0, 1\)"),
    ("--train.beta2=-0.9", r"train.beta2=-0.9 is out of range"),
    ("--train.grad_clip=-1", r"train.grad_clip=-1.0 is out of range: .*or 0 to disable clipping"),
    ("--parallel.tp=0", r"parallel.tp=0 is out of range: give a degree of 1 or more, or -1"),
    ("--parallel.dp_shard=-2", r"parallel.dp_shard=-2 is out of range"),
    ("--parallel.pp=0", r"parallel.pp=0 is out of range"),
    ("--parallel.pp_microbatches=-1", r"parallel.pp_microbatches=-1 is out of range"),
    ("--parallel.pp_virtual_stages=0", r"parallel.pp_virtual_stages=0 is out of range"),
    ("--checkpoint.signal_grace_s=-1", r"checkpoint.signal_grace_s=-1.0 is out of range"),
    ("--health.hang_action=abort", r"health.hang_action='abort' is not one of exit, report"),
])
def test_bad_values_name_the_option(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


@pytest.mark.parametrize("override", ["--health.straggler_threshold=0", "--health.straggler_threshold=1",
                                      "--health.hang_timeout_s=0", "--checkpoint.interval_steps=0",
                                      "--checkpoint.keep_every=0", "--train.grad_clip=0", "--model.dim=0",
                                      "--parallel.dp_shard=-1", "--parallel.pp_microbatches=0",
                                      "--health.hang_action=report"])
def test_edge_values_that_mean_off_or_default_are_accepted(override):
    option, _, text = override[2:].partition("=")
    section, key = option.split(".")
    job = load_config(None, [override])
    value = getattr(getattr(job, section), key)
    assert (value == float(text)) if isinstance(value, (int, float)) else value == text  # kept, not clamped


def test_unwritable_run_dir_is_one_line_naming_the_option(tmp_path, capsys):
    from meshrun.train.cli import main as train_main

    (tmp_path / "a_file").write_text("")
    run_dir = tmp_path / "a_file" / "run"  # under a file: cannot be created, whoever runs the test
    assert train_main([f"--run.dir={run_dir}", "--train.steps=1", f"--data.source={pytest.__file__}",
                       "--checkpoint.final=false"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"meshrun train: error: run.dir='{run_dir}': cannot create {run_dir} (")
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_compile_accepts_boolean_spellings_and_auto(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("[train]\ncompile = true\n")  # a TOML boolean, as written before compile took 'auto'
    assert load_config(path).train.compile == "true"
    assert load_config(None, ["--train.compile=off"]).train.compile == "false"
    assert load_config(None).train.compile == "auto"


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="--config .*nope.toml: no such file"):
        load_config(tmp_path / "nope.toml")


def test_defaults_validate_and_normalise_the_tri_state_options():
    job = JobConfig()
    job.train.compile = True  # a TOML boolean, as the field held before it took 'auto'
    job.validate()
    assert (job.train.compile, job.train.cuda_graphs, job.parallel.fsdp_reshard_after_forward) == ("true", "auto", "auto")
    job.train.grad_clip = -1.0
    with pytest.raises(ConfigError, match="train.grad_clip"):
        job.validate()  # validate() checks the fields it is given, not only what load_config parsed


def test_choice_lists_are_defined_once_and_shared():
    """The field annotation, validation and `meshrun plan`'s argparse choices all read one tuple per option."""
    import typing

    from meshrun import config as c
    from meshrun.planner import parse_args

    hints = typing.get_type_hints(c.ParallelConfig)
    assert typing.get_args(hints["pp_schedule"]) == c.PIPELINE_SCHEDULES == ("auto", "gpipe", "1f1b",
                                                                             "interleaved1f1b", "interleavedzb",
                                                                             "loopedbfs")
    assert typing.get_args(hints["pp_balance"]) == c.PIPELINE_BALANCES == ("cost", "blocks")
    assert set(c.MULTI_STAGE_SCHEDULES) < set(c.PIPELINE_SCHEDULES)
    assert typing.get_args(hints["activation_checkpoint"]) == c.ACTIVATION_CHECKPOINT_MODES
    for schedule in c.PIPELINE_SCHEDULES:
        assert parse_args(["--pp-schedule", schedule]).pp_schedule == schedule
    for mode in c.ACTIVATION_CHECKPOINT_MODES:
        assert parse_args(["--activation-checkpoint", mode]).activation_checkpoint == mode
    for balance in c.PIPELINE_BALANCES:
        assert parse_args(["--pp-balance", balance]).pp_balance == balance
    with pytest.raises(SystemExit):
        parse_args(["--pp-schedule", "zigzag"])
    for option in ("parallel.pp_schedule=zigzag", "dist.backend=mpi", "data.format=csv", "train.dtype=fp16"):
        with pytest.raises(ConfigError, match=option.split("=")[0]):
            load_config(overrides=[f"--{option}"])


def test_the_config_classes_session_takes_are_importable_from_meshrun():
    """docs/api.md writes Session(checkpoint=meshrun.CheckpointConfig(...), replicas=meshrun.ReplicaConfig(...))."""
    import meshrun
    from meshrun import config

    assert meshrun.CheckpointConfig is config.CheckpointConfig and meshrun.ReplicaConfig is config.ReplicaConfig
    assert {"CheckpointConfig", "ReplicaConfig"} <= set(meshrun.__all__)
