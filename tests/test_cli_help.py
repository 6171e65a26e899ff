"""What the command line says about itself: every command's --help in plain text, every config option in
`meshrun train --help` (from the same docstrings as docs/config.md), suggestions for a wrong option across
sections, and meshrun's own console lines in one format."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import logging
import re
from pathlib import Path
from typing import get_type_hints

import pytest

from meshrun import cli
from meshrun.config import ConfigError, JobConfig, load_config
from meshrun.help_format import plain

ROOT = Path(__file__).resolve().parents[1]
RST = re.compile(r"``|:[a-z]+:`")


def _help(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            code = cli.main(argv)
        except SystemExit as exc:  # argparse leaves after printing the help
            code = exc.code
    assert code in (0, None), (argv, out.getvalue())
    return out.getvalue()


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_every_commands_help_is_plain_text(command):
    text = _help([command, "--help"])
    assert text.startswith(f"usage: meshrun {command}"), text[:200]
    assert not RST.search(text), RST.search(text).group(0) + " in: " + text


def test_plain_turns_sphinx_markup_into_its_words():
    assert plain("``meshrun sample CHECKPOINT``: see :func:`meshrun.diag.bench_ops.operation` and "
                 ":class:`~meshrun.env.ProcessPlacement`") == ("meshrun sample CHECKPOINT: see "
                                                         "meshrun.diag.bench_ops.operation and ProcessPlacement")


def test_top_level_help_says_bench_measures_collectives():
    line = next(line for line in _help(["--help"]).splitlines() if line.strip().startswith("bench "))
    assert "collective bandwidth" in line and "training throughput" not in line


def test_train_help_lists_every_config_option_by_section_with_its_description():
    text = _help(["train", "--help"])
    positions = []
    for section, cls in get_type_hints(JobConfig).items():
        positions.append(text.index(f"\n[{section}] "))
        for field in dataclasses.fields(cls):
            assert re.search(rf"\n  --{section}\.{field.name}=\S*", text), f"{section}.{field.name} missing"
    assert positions == sorted(positions)  # in the order of the config
    assert re.search(r"--train\.lr=0\.003 +Peak learning rate\.", text)
    assert re.search(r"--train\.nonfinite=skip +A step whose gradient norm.*One of: skip, stop, off\.", text, re.S)
    assert "--run.print_config=true" in text and "--checkpoint.dir=\"\"" in text


@pytest.mark.parametrize("wrong, meant", [("train.learning_rate", "train.lr"), ("train.dp_shard", "parallel.dp_shard"),
                                          ("trian.stpes", "train.steps"), ("model.n_layer", "model.n_layers"),
                                          ("checkpoint.save_total_limit", "checkpoint.keep_last"),
                                          ("parallel.fsdp", "parallel.dp_shard"),
                                          ("parallel.tensor_model_parallel_size", "parallel.tp"),
                                          ("parallel.data_parallel_replicate_degree", "parallel.dp_replicate"),
                                          ("train.gradient_checkpointing", "parallel.activation_checkpoint"),
                                          ("data.path", "data.source")])
def test_a_wrong_option_gets_the_closest_one_of_any_section(wrong, meant):
    with pytest.raises(ConfigError, match=rf"^unknown config option '{wrong}' \(did you mean '{meant}'\?\)"):
        load_config(None, [f"--{wrong}=1"])


@pytest.mark.parametrize("argv, message", [
    (["trian"], "meshrun: unknown command 'trian' (did you mean 'train'?); choose one of train, launch"),
    (["train", "--fresj"], "meshrun train: error: unexpected argument '--fresj' (did you mean --fresh?)"),
    (["train", "--dryrun"], "meshrun train: error: unexpected argument '--dryrun' (did you mean --dry-run?)"),
    (["train", "--steps=5"], "meshrun train: error: unexpected argument '--steps=5' (did you mean --train.steps?)"),
])
def test_a_mistyped_command_or_flag_gets_the_closest_one(capsys, argv, message):
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.startswith(message)


def test_docs_config_md_is_what_the_generator_writes():
    spec = importlib.util.spec_from_file_location("gen_config_doc", ROOT / "scripts" / "gen_config_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (ROOT / "docs" / "config.md").read_text() == module.render(), \
        "docs/config.md is stale: run python3 scripts/gen_config_doc.py"


def test_meshrun_log_lines_on_the_console_look_like_its_printed_warnings(tmp_path, capsys):
    from meshrun.env import ProcessPlacement
    from meshrun.train.run_folder import _setup_logging

    buffer = _setup_logging(ProcessPlacement.detect({}))  # the rank log's lines, held until the run folder opens
    logger = logging.getLogger("meshrun")
    try:
        logging.getLogger("meshrun.ckpt").warning("replacing %s", "step_00000004")
        logging.getLogger("meshrun").info("only in the rank log")
        lines = [buffer.format(record) for record in buffer.buffer]
    finally:
        for handler in list(logger.handlers):
            handler.close()
            logger.removeHandler(handler)
    assert capsys.readouterr().err == "warning: replacing step_00000004\n"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d [\d:,]+ \[rank 0\] WARNING replacing step_00000004", lines[0]), lines
    assert lines[1].endswith("[rank 0] INFO only in the rank log")


def test_run_print_config_false_leaves_the_config_out_of_the_header(tmp_path, capsys):
    from meshrun.train.trainer import Trainer

    common = ["--train.steps=2", "--train.eval_every=0", "--data.max_bytes=100000", "--checkpoint.final=false",
              "--run.progress=lines"]
    for shown in (True, False):
        trainer = Trainer(load_config(None, [f"--run.dir={tmp_path / str(shown)}", *common,
                                             f"--run.print_config={str(shown).lower()}"]))
        trainer.close()
        out = capsys.readouterr().out
        assert f"config: {tmp_path / str(shown) / 'config.toml'}" in out
        assert ("  [train] steps=2" in out) == shown, out
