"""The pure parts of benchmarks/links/wan.py: crossing T on an eval curve, S, speed-ups, dp's computed time, the tables."""

import json

import pytest

from benchmarks.links import wan

CURVE = [{"seconds": 0.0, "tokens": 0, "loss": 5.0}, {"seconds": 10.0, "tokens": 1000, "loss": 4.0},
         {"seconds": 20.0, "tokens": 2000, "loss": 3.0}, {"seconds": 30.0, "tokens": 3000, "loss": 3.5}]


def test_target_reached_between_points_is_interpolated_linearly():
    assert wan.first_reach(CURVE, 3.5) == pytest.approx({"seconds": 15.0, "tokens": 1500})
    assert wan.first_reach(CURVE, 3.75) == pytest.approx({"seconds": 12.5, "tokens": 1250})


def test_target_reached_exactly_at_a_point_is_that_point():
    assert wan.first_reach(CURVE, 4.0) == {"seconds": 10.0, "tokens": 1000}
    assert wan.first_reach(CURVE, 3.0) == {"seconds": 20.0, "tokens": 2000}


def test_the_first_crossing_counts_and_a_target_never_reached_is_none():
    assert wan.first_reach(CURVE, 3.5)["seconds"] == pytest.approx(15.0)  # not the later point at 3.5
    assert wan.first_reach(CURVE, 2.9) is None
    assert wan.first_reach(CURVE, 6.0) == {"seconds": 0.0, "tokens": 0}


def test_step_seconds_are_gaps_within_one_attempt_and_utilisation_is_busy_over_the_window():
    metrics = {"learner-0": [{"t": 10.0, "busy": 1.0}, {"t": 12.0, "busy": 1.0}, {"t": 14.0, "busy": 1.0}],
               "learner-1": [{"t": 10.0, "busy": 1.0, "restarts": 0}, {"t": 50.0, "busy": 1.0, "restarts": 1},
                             {"t": 52.0, "busy": 1.0, "restarts": 1}]}
    assert wan.step_seconds(metrics) == 2.0  # the gap across the restart is not a step
    assert wan.window(metrics) == (9.0, 52.0)
    assert wan.utilisation(metrics, 2) == pytest.approx(6.0 / (2 * 43.0))


def test_slowdown_speed_up_and_dp_time_from_its_trajectory():
    assert wan.slowdown(0.5, 0.1) == pytest.approx(5.0)
    assert wan.dp_time_to_target(40.5, 0.5) == pytest.approx(20.25)
    assert wan.speed_up(20.0, 8.0) == 2.5
    assert wan.speed_up(20.0, None) is None
    assert wan.speed_up(None, 8.0) is None


def _run(mode, loss_curve, step_seconds, final, label="4096", steps=100, link=None):
    curve = [{"seconds": s, "tokens": k, "loss": x} for s, k, x in loss_curve]
    return {"mode": mode, "learners": 4, "curve": curve, "final_loss": final, "tokens_trained": curve[-1]["tokens"],
            "step_seconds": step_seconds, "utilisation": 0.5, "wire_bytes": 2e6, "link_bytes": link,
            "tokens_per_step": 40, "steps": steps, "label": label, "budget": 4096 if label == "4096" else steps}


def sweep():
    # dp: 100 steps of 40 tokens, final loss 2.0 → T = 2.1, first reached at step 50 (tokens 2000)
    dp = [(0, 0, 5.0), (5, 2000, 2.1), (10, 4000, 2.0)]
    return {"model": "tiny", "modes": ["dp", "decoupled"], "rates": ["none", "20mbit"], "kind": "tokens",
            "learners": 4, "seed": 0, "margin": 0.05, "target": None, "speeds": None, "chaos": None,
            "budget_label": "4096", "budgets": None, "runs": {
                "dp@none@4096": _run("dp", dp, 0.1, 2.0),
                "decoupled@none@4096": _run("decoupled", [(0, 0, 5.0), (4, 2000, 2.2), (8, 4000, 2.0)], 0.1, 2.0),
                "dp@20mbit@10steps": _run("dp", [(0, 0, 5.0), (5, 400, 4.0)], 0.5, 4.0, "10steps", 10, 1e6),
                "decoupled@20mbit@4096": _run("decoupled", [(0, 0, 5.0), (6, 4000, 2.3)], 0.12, 2.3, link=3e6)}}


def test_analysis_of_a_small_sweep():
    rows = {(r["rate"], r["mode"]): r for r in wan.analyse(sweep())}
    assert wan.target(sweep()) == pytest.approx(2.1)
    dp0, dec0 = rows["none", "dp"], rows["none", "decoupled"]
    assert dp0["S"] == 1.0 and dp0["time_to_T"] == pytest.approx(50 * 0.1) and dp0["tokens_to_T"] == 2000
    assert dec0["time_to_T"] == pytest.approx(6.0) and dec0["speed_up"] == pytest.approx(5 / 6)
    dp20, dec20 = rows["20mbit", "dp"], rows["20mbit", "decoupled"]
    assert dp20["S"] == pytest.approx(5.0)
    assert dp20["time_to_T"] == pytest.approx(50 * 0.5)  # unshaped trajectory × step time on the link
    assert dp20["scaled"] and dp20["wire_bytes"] == pytest.approx(2e6 * 10) and dp20["link_bytes"] == 1e7
    assert dec20["time_to_T"] is None and dec20["speed_up"] is None and dec20["share"] is None


def test_markdown_of_a_small_sweep():
    text = wan.markdown(sweep())
    lines = text.splitlines()
    assert lines[0].startswith("| link | mode | budget |") and len(lines[1].split("|")) == len(wan.COLUMNS) + 2
    assert "| unshaped | dp | 4,096 | 0.100 | 1.0× | 5.0 s (clock 5.0 s) | 1.00× | 1.00 | 2,000 |" in text
    assert "| 20mbit | dp | 10 steps | 0.500 | 5.0× | 25.0 s | 1.00× | 0.20 | 2,000 |" in text
    assert "| 20mbit | decoupled | 4,096 | 0.120 | 5.0× | not reached | – | – | – |" in text
    assert "20.0*" in text and "10.0*" in text  # dp's probe bytes scaled to the full budget, marked
    assert "T = dp's final unshaped loss × 1.05 = 2.1000" in text


def test_the_bandwidth_models_prediction_for_a_run_on_its_own_link(tmp_path):
    # what `diloco simulate bandwidth --from-run` reads: 10M parameters, P = H = 4, int4, 10 Mbit per learner-step
    report = {"mode": "decoupled", "learners": 4, "wall_seconds": 120.0, "tokens_trained": 4_000_000,
              "wire_bytes": 2_000_000_000, "model_parameters": 10_000_000, "step_seconds_median": 0.25,
              "config": {"fragments": 4, "sync_every": 4, "overlap": 2, "codec": "int4"},
              "per_learner": [{"id": f"l{i}", "steps": 400, "tokens": 1_000_000} for i in range(4)]}
    (tmp_path / "report.json").write_text(json.dumps(report))
    slow = wan.projected(tmp_path, "5mbit")  # 10 Mbit a step over 5 Mbit/s: 2 s a step against 0.25 s of compute
    assert slow["step_seconds"] == pytest.approx(2.0) and slow["utilisation"] == pytest.approx(0.125)
    assert slow["overhead"] == pytest.approx(10e6 / (2.5e6 * 4.125))  # measured ÷ modelled bits per step
    assert wan.projected(tmp_path, "none")["utilisation"] == pytest.approx(1.0)
    assert wan.projected(tmp_path / "missing", "5mbit") is None
    run = {"step_seconds": 2.1, "utilisation": 0.11, "projected": slow}
    table = wan.projection_markdown({"runs": {"decoupled@5mbit@1600000": run, "dp@none@1600000": {"x": 1}}})
    assert "| 5mbit | decoupled | 0.250 | 2.100 | 2.000 | 0.11 | 0.12 | 0.97 |" in table
    assert "dp" not in table.split("\n", 2)[2]  # runs without a prediction are left out
