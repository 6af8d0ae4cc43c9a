import json

from click.testing import CliRunner

from specops.cli import main


def test_small_simulation_reports_measured_figures(redis_url, tmp_path):
    out = tmp_path / "sim.json"
    result = CliRunner().invoke(main, ["simulate", "--pods", "6", "--classes", "5", "--ticks", "40", "--seed", "3",
                                       "--redis", redis_url, "--json", str(out)])
    assert result.exit_code == 0, result.output
    fig = json.loads(out.read_text())
    for key in ("adaptive_vs_oracle", "adaptive_vs_best_fixed", "fallback_detect_ticks", "bad_canary_rolled_back",
                "tick_ms_median"):
        assert key in fig
    tps = fig["tokens_per_s"]
    # the oracle is an upper bound of every strategy on the same expected-speed accounting
    assert all(v <= tps["oracle"] * 1.0001 for k, v in tps.items())
    assert 0.8 < fig["adaptive_vs_oracle"] <= 1.0
    assert fig["adaptive_vs_best_fixed"] > 1.0
    assert fig["bad_canary_rolled_back"] is True
    assert fig["fallback_detect_ticks"] is not None and 0 <= fig["fallback_detect_ticks"] <= 2
    assert 0 < fig["tick_ms_median"] < 200
    assert len(fig["timeline"]) == 40
    assert fig["audit_events"] > 0


def test_simulation_is_deterministic_in_its_seed(redis_url, tmp_path):
    runs = []
    for i in range(2):
        out = tmp_path / f"{i}.json"
        result = CliRunner().invoke(main, ["simulate", "--pods", "3", "--classes", "2", "--ticks", "20", "--seed",
                                           "7", "--redis", redis_url, "--json", str(out)])
        assert result.exit_code == 0, result.output
        runs.append(json.loads(out.read_text()))
    assert runs[0]["tokens_per_s"] == runs[1]["tokens_per_s"]


def test_bad_options_are_one_line_errors():
    result = CliRunner().invoke(main, ["simulate", "--ticks", "5"])
    assert result.exit_code != 0 and "ticks" in result.output
