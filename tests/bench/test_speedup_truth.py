"""``specops bench speedup-truth``: telemetry speed-up beside client-side ground truth."""

import json

import pytest
from click.testing import CliRunner

from specops.bench import speedup_truth as st
from specops.cli import main
from specops.policies import load_policy

METRICS = """\
# TYPE specops_plain_decode_seconds_estimate_total counter
specops_plain_decode_seconds_estimate_total{class="truth",method="draft"} 3.0
specops_plain_decode_seconds_estimate_total{class="truth",method="ar"} 1.5
specops_plain_decode_seconds_estimate_total{class="other",method="ar"} 100.0
# TYPE specops_decode_seconds_total counter
specops_decode_seconds_total{class="truth",method="draft"} 2.0
specops_decode_seconds_total{class="truth",method="ar"} 1.5
# TYPE specops_generated_tokens_total counter
specops_generated_tokens_total{class="truth",method="draft"} 40.0
"""


def test_class_counters_sum_the_class_over_methods():
    got = st.class_counters(METRICS)
    assert got == {st.PLAIN_METRIC: 4.5, st.WALL_METRIC: 3.5, st.TOKENS_METRIC: 40.0}
    assert st.class_counters(METRICS, "nobody") == {st.PLAIN_METRIC: 0.0, st.WALL_METRIC: 0.0, st.TOKENS_METRIC: 0.0}


def test_telemetry_speedup_is_the_ratio_of_the_deltas():
    before = {st.PLAIN_METRIC: 1.0, st.WALL_METRIC: 1.0, st.TOKENS_METRIC: 0.0}
    after = {st.PLAIN_METRIC: 4.0, st.WALL_METRIC: 3.0, st.TOKENS_METRIC: 10.0}
    assert st.telemetry_speedup(before, after) == pytest.approx(1.5)
    assert st.telemetry_speedup(after, after) is None  # nothing decoded in the cell


def _cell(repeat, c, mode, tps, tel):
    return {"repeat": repeat, "concurrency": c, "mode": mode, "tokens_per_s": tps, "telemetry_speedup": tel,
            "spec_step_share": 0.0 if mode == "plain" else 0.9}


def test_summary_pairs_each_mode_with_the_plain_cell_of_its_repeat():
    cells = [_cell(0, 4, "plain", 100.0, 1.0), _cell(0, 4, "forced", 150.0, 1.8), _cell(0, 4, "spec", 100.0, 1.0),
             _cell(1, 4, "plain", 50.0, 1.02), _cell(1, 4, "forced", 100.0, 1.6), _cell(1, 4, "spec", 55.0, 1.1),
             _cell(2, 4, "forced", 999.0, 9.0)]  # no plain cell in repeat 2: not paired
    rows = {r["mode"]: r for r in st.summarize(cells, [4])}
    forced = rows["forced"]
    assert forced["repeats"] == 2
    assert forced["truth_speedup"] == {"median": 1.75, "min": 1.5, "max": 2.0}  # 150/100 and 100/50, per repeat
    assert forced["telemetry_speedup"]["median"] == pytest.approx(1.7)
    assert forced["relative_error"]["min"] == pytest.approx(1.6 / 2.0 - 1)
    assert forced["relative_error"]["max"] == pytest.approx(1.8 / 1.5 - 1)
    assert forced["telemetry_speedup_plain"] == {"median": 1.01, "min": 1.0, "max": 1.02}
    assert rows["spec"]["truth_speedup"]["max"] == pytest.approx(1.1)
    table = st.format_table({"config": {"method": "draft", "gamma": 4, "max_tokens": 48, "repeats": 2},
                             "results": list(rows.values())})
    assert "1.75 (1.50-2.00)" in table and "forced" in table


def test_cell_order_puts_every_mode_first_and_last():
    orders = [st.cell_order(r, 0) for r in range(6)]
    assert all(sorted(o) == sorted(st.MODES) for o in orders)
    assert {o[0] for o in orders} == set(st.MODES) and {o[-1] for o in orders} == set(st.MODES)


def test_the_policy_is_valid_and_speculates_with_the_method_asked():
    for method in st.METHODS:
        policy = load_policy(st.policy_text(st.TruthConfig(method=method, gamma=3)))
        (rc,) = policy.classes
        assert rc.name == st.CLASS and rc.method == method and policy.default_class == st.CLASS
        assert rc.adaptation.mode == "fixed"


def test_bad_settings_are_refused():
    for bad in (dict(concurrency=[]), dict(concurrency=[0]), dict(repeats=0), dict(method="auto"), dict(gamma=0),
                dict(max_tokens=1), dict(requests=0), dict(settle=-1)):
        with pytest.raises(st.TruthError):
            st.TruthConfig(**bad).validate()
    assert st.TruthConfig().cell_requests(1) == 32 and st.TruthConfig().cell_requests(16) == 128
    assert st.TruthConfig(requests=5).cell_requests(16) == 5


def test_cli_option_errors_are_one_line():
    runner = CliRunner()
    res = runner.invoke(main, ["bench", "speedup-truth", "--concurrency", "1,x"])
    assert res.exit_code == 2 and "comma-separated integers" in res.output
    res = runner.invoke(main, ["bench", "speedup-truth", "--mix", "code"])
    assert res.exit_code == 1 and "--mix wants" in res.output and "Traceback" not in res.output


def test_a_small_run_reports_plain_and_speculating_cells(tmp_path):
    out = tmp_path / "truth.json"
    res = CliRunner().invoke(main, ["bench", "speedup-truth", "--concurrency", "2", "--repeats", "1", "--requests",
                                    "4", "--settle", "0", "--max-tokens", "8", "--threads", "1", "--quiet",
                                    "--json", str(out)])
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert sorted(c["mode"] for c in report["cells"]) == sorted(st.MODES)
    for cell in report["cells"]:
        assert cell["tokens"] == 4 * 8 and cell["telemetry_tokens"] == 4 * 8  # the scrape saw exactly the cell
        assert cell["telemetry_speedup"] is not None and cell["tokens_per_s"] > 0
    assert [c["spec_step_share"] for c in report["cells"] if c["mode"] == "plain"] == [0.0]
    assert {r["mode"] for r in report["results"]} == set(st.SPEC_MODES)
    assert "truth" in res.output


def test_a_model_is_served_alone_with_ngram_drafting(tmp_path):
    """--model serves that target alone: a method that needs another model is refused in one
    line; with ngram the cells run on it and the report names it."""
    from specops.assets import TARGET_DIR

    with pytest.raises(st.TruthError, match="--method ngram"):
        st.TruthConfig(model="some-model", method="draft").validate()
    res = CliRunner().invoke(main, ["bench", "speedup-truth", "--model", str(TARGET_DIR), "--method", "draft"])
    assert res.exit_code == 1 and "--method ngram" in res.output and "Traceback" not in res.output
    out = tmp_path / "truth.json"
    res = CliRunner().invoke(main, ["bench", "speedup-truth", "--model", str(TARGET_DIR), "--method", "ngram",
                                    "--concurrency", "1", "--repeats", "1", "--requests", "2", "--settle", "0",
                                    "--max-tokens", "8", "--threads", "1", "--quiet", "--json", str(out)])
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert report["config"]["model"] == str(TARGET_DIR) and report["config"]["method"] == "ngram"
    assert all(cell["tokens"] == 2 * 8 for cell in report["cells"])
    assert f"speed-up truth on {report['model']}" in res.output
