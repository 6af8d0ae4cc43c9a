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


def test_timeline_events_are_fallbacks_returns_and_gamma_changes():
    from specops.controller.sim_plot import TimelineEvent, timeline_events

    rows = [{"tick": 0, "gamma": {"a": 4, "b": 2}}, {"tick": 1, "gamma": {"a": 0, "b": 2}},
            {"tick": 2, "gamma": {"a": 0, "b": 3, "c": 1}}, {"tick": 3, "gamma": {"a": 1, "b": 3, "c": 1}}]
    assert timeline_events(rows) == [TimelineEvent(1, "a", "fallback", 4, 0), TimelineEvent(2, "b", "gamma", 2, 3),
                                     TimelineEvent(3, "a", "return", 0, 1)]


def test_simulate_plot_marks_events_and_keeps_legends_off_the_lines():
    import pytest

    plt = pytest.importorskip("matplotlib.pyplot")
    from types import SimpleNamespace

    from specops.controller.sim_plot import timeline_figure

    gammas = [{"a": 4, "b": 2}, {"a": 0, "b": 2}, {"a": 0, "b": 3}, {"a": 2, "b": 3}]
    rows = [{"tick": k, "adaptive": 100.0 + k, "oracle": 110.0, "gamma": g, "canary_weight": 0}
            for k, g in enumerate(gammas)]
    figures = {"best_fixed": "fixed_2", "tokens_per_s": {"fixed_2": 95.0}, "pods": 2, "classes": 2,
               "adaptive_vs_oracle": 0.93, "adaptive_vs_best_fixed": 1.08}
    fig = timeline_figure(SimpleNamespace(timeline=rows, figures=figures), plt)
    try:
        top, bottom = fig.axes
        def gids(ax):
            return sorted(ln.get_gid() for ln in ax.get_lines() if (ln.get_gid() or "").startswith("controller"))
        assert gids(top) == ["controller-event:fallback", "controller-event:return"]
        assert gids(bottom) == ["controller-event:fallback", "controller-event:gamma", "controller-event:return"]
        assert [t.get_text() for t in top.texts] == ["a", "a"]  # the class named at its fallback and return
        for ax in (top, bottom):
            legend = ax.get_legend()
            assert legend.get_bbox_to_anchor().x0 >= ax.get_window_extent().x1 - 1  # beside the axes
        labels = [t.get_text() for t in top.get_legend().get_texts()]
        assert "fallback (γ → 0)" in labels and "return to speculation" in labels
    finally:
        plt.close(fig)
