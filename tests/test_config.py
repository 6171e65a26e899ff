"""Config loading, overrides and the seeds' global-batch arithmetic (pure logic, no process group)."""

import pytest

from meshrun.config import ConfigError, JobConfig, TrainConfig, load_config, resolve_batch


def test_seeds_global_batch_example():
    # seeds: 8 per GPU x 8 GPUs per node x 4 nodes x 2 accumulation steps = 512
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


@pytest.mark.parametrize("override, message", [
    ("--train.steps=abc", "train.steps='abc' is not a valid int"),
    ("--train.compile=maybe", "train.compile='maybe' is not one of auto, true, false"),
    ("--train.fused_optimizer=maybe", "is not a boolean"),
    ("--train.attention=fa4", "train.attention='fa4' is not one of"),
    ("--train.dtype=fp8", "train.dtype='fp8' is not one of"),
    ("--train.steps=0", "train.steps must be >= 1"),
])
def test_bad_values_name_the_option(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_compile_accepts_boolean_spellings_and_auto(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("[train]\ncompile = true\n")  # a TOML boolean, as written before compile took 'auto'
    assert load_config(path).train.compile == "true"
    assert load_config(None, ["--train.compile=off"]).train.compile == "false"
    assert load_config(None).train.compile == "auto"


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="--config .*nope.toml: no such file"):
        load_config(tmp_path / "nope.toml")


def test_defaults_validate():
    JobConfig().validate()
