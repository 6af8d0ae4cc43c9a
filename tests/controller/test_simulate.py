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


def test_seeds_report_mean_minimum_and_goals(redis_url, tmp_path):
    out = tmp_path / "seeds.json"
    # seeds other than 0 jitter every class's acceptance and share: the worlds differ
    result = CliRunner().invoke(main, ["simulate", "--pods", "3", "--classes", "3", "--ticks", "20", "--seed", "4",
                                       "--seeds", "3", "--redis", redis_url, "--json", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["seeds"] == [4, 5, 6] and len(doc["runs"]) == 3
    ratios = doc["adaptive_vs_best_fixed"]
    assert doc["mean_adaptive_vs_best_fixed"] == round(sum(ratios) / 3, 4)
    assert doc["min_adaptive_vs_best_fixed"] == min(ratios) and doc["min_adaptive_vs_oracle"] == min(doc["adaptive_vs_oracle"])
    assert [r["seed"] for r in doc["runs"]] == [4, 5, 6]
    assert len(set(ratios)) > 1  # different seeds, different scenarios
    lines = result.output.splitlines()
    assert any(line.split()[:1] == ["mean"] for line in lines) and any(line.split()[:1] == ["min"] for line in lines)
    goal_lines = [line for line in lines if line.startswith("goal ")]
    assert len(goal_lines) == 3
    met = doc["goals"]["adaptive/oracle >= 0.95 on every seed"]
    assert any(("NOT met" not in line) == met for line in goal_lines if "oracle" in line)


def test_seeds_refuse_plot():
    result = CliRunner().invoke(main, ["simulate", "--seeds", "2", "--plot", "x.png"])
    assert result.exit_code == 2 and "--plot draws one run" in result.output


def test_seed_zero_is_the_reference_world_and_other_seeds_vary_it():
    from specops.controller.sim_model import _TEMPLATES, build_scenario

    ref = build_scenario(10, 5, 100, 0)
    assert [c.name for c in ref.classes] == [t[0] for t in _TEMPLATES]
    assert ref.classes[0].alpha == (0.95, 0.92)
    others = [build_scenario(10, 5, 100, s) for s in (1, 2)]
    assert all(o.classes != ref.classes for o in others) and others[0].classes != others[1].classes
    assert build_scenario(10, 5, 100, 1) == others[0]  # deterministic in the seed
    for o in others:
        assert all(0.05 <= a <= 0.97 for c in o.classes for a in c.alpha)
