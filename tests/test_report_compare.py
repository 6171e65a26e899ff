"""`meshrun report --compare` and the report's figures on hand-written records (no training run needed)."""

import json

import pytest

from meshrun.report.cli import default_out, main
from meshrun.report.compare import compare
from meshrun.report.load import load_run


def _run(path, records):
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps({"time": 1.0 + i, **r}) + "\n"
                                                for i, r in enumerate(records)))
    return path


def _train(step, loss, tokens_per_step=100):
    return {"kind": "train", "step": step, "loss": loss, "tokens_seen": step * tokens_per_step}


def test_losses_are_matched_by_tokens_and_the_largest_difference_decides(tmp_path, capsys):
    a = _run(tmp_path / "a", [_train(s, 5.0 - 0.1 * s) for s in (2, 4, 6)] + [{"kind": "eval", "step": 6, "loss": 4.0}])
    # B logged every step with half the batch per step: its steps 4, 8, 12 hold A's token counts
    b_records = [_train(s, 5.0 - 0.05 * s, tokens_per_step=50) for s in range(1, 13)]
    b_records[7]["loss"] = (5.0 - 0.4) * 1.002  # 0.2% off at A's step 4
    b = _run(tmp_path / "b", b_records + [{"kind": "eval", "step": 6, "loss": 4.0}])
    assert main(["--compare", str(a), str(b), "--tolerance", "0.01"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == ("  training loss: 3 matching points, largest difference 0.002 at step 4, 400 tokens "
                      "(A 4.600000, B 4.609200)")
    assert out[-1] == "agree: largest 0.002 <= tolerance 0.01"
    assert main(["--compare", str(a), str(b), "--tolerance", "0.001"]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "DIFFER: largest 0.002 > tolerance 0.001"


def test_compare_refuses_runs_without_common_points_and_a_wrong_count(tmp_path, capsys):
    a = _run(tmp_path / "a", [_train(2, 5.0)])
    b = _run(tmp_path / "b", [_train(3, 5.0)])
    assert main(["--compare", str(a), str(b)]) == 2
    assert "share no logged step or token count" in capsys.readouterr().err
    assert main(["--compare", str(a)]) == 2
    assert "--compare takes two run directories (RUN_A RUN_B), got 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="compare runs of one job"):
        compare(load_run(a), load_run(b))


def test_a_multi_run_report_goes_beside_the_runs_not_into_one_of_them(tmp_path):
    a, b = tmp_path / "a", tmp_path / "x" / "b"
    assert default_out([a]) == a / "report"
    assert default_out([a, b]) == tmp_path.resolve() / "report-a-vs-b"


def test_memory_axis_starts_at_zero_so_a_tiny_change_stays_flat(tmp_path):
    pytest.importorskip("matplotlib", reason="meshrun report needs matplotlib (pip install -e '.[test]')")
    from meshrun.report import plots

    plt = plots._plt()
    fig, ax = plt.subplots()
    values = [2.0, 2.0, 2.0 + 0.2 / 1024]  # GiB: 0.2 MiB of growth
    ax.plot([1, 2, 3], values)
    plots.zero_based(ax, values)
    bottom, top = ax.get_ylim()
    assert bottom == 0 and top == pytest.approx(2.3, rel=0.01)  # the growth is 0.004% of the axis, not all of it
    ax.plot([1, 2, 3], [1, 2, 3], label="curve")
    plots.legend_outside(ax)
    fig.canvas.draw()
    legend, axes_box = ax.get_legend().get_window_extent(), ax.get_window_extent()
    assert legend.x0 >= axes_box.x1  # beside the axes: it cannot cover a curve
    plt.close(fig)
    assert plots.RESTART_STYLE["ls"] != plots.VALIDATION_STYLE["ls"] and plots.RESTART_STYLE["color"] == "0.45"


def test_memory_plot_switches_to_mib_under_a_gib_and_cpu_runs_show_no_mfu(tmp_path):
    pytest.importorskip("matplotlib", reason="meshrun report needs matplotlib (pip install -e '.[test]')")
    from meshrun.report import plots

    path = _run(tmp_path / "cpu", [{"kind": "start", "step": 0}, _train(2, 5.0), _train(4, 4.0),
                                   {"kind": "ranks", "step": 2, "peak_mem_gib": [0.25, 0.26]},
                                   {"kind": "ranks", "step": 4, "peak_mem_gib": [0.25, 0.2602]}])
    run = load_run(path)
    svg = plots.plot_memory([run], tmp_path).read_text()
    assert "MiB (highest rank" in svg and "GiB (highest rank" not in svg
    assert not plots.has_mfu([run]) and "MFU" not in plots.plot_throughput([run], tmp_path).read_text()
