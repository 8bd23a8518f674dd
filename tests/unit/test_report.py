"""Accounting and display helpers of `diloco run`'s report."""

import pytest
from rich.console import Console

from diloco.run.accounting import advance_interval, fault_windows, goodput, healthy_rate, new_steps, tokens_per_life, uptime
from diloco.status_view import human_bytes, progress_table


def test_a_round_held_for_predicted_pushes_is_not_downtime():
    # some fragment every H/P = 1 step, with 2x slack; held rounds may come up to grace_expect_steps later
    assert advance_interval({"sync_every": 24, "fragments": 24}, 0.05) == pytest.approx(0.1)
    assert advance_interval({"sync_every": 24, "fragments": 24, "grace_expect_steps": 24.0}, 0.05) == pytest.approx(1.3)
    assert advance_interval({"sync_every": 24, "fragments": 1, "grace_expect_steps": 0.0}, 0.5) == pytest.approx(24.0)


def test_uptime_is_the_share_of_windows_with_an_advance():
    assert uptime([0.5, 1.5, 2.5, 3.5], start=0, end=4, interval=1) == 1.0
    assert uptime([0.5, 0.6, 3.5], start=0, end=4, interval=1) == 0.5  # windows 1 and 2 saw nothing
    assert uptime([], start=0, end=4, interval=1) == 0.0
    assert uptime([9.0], start=0, end=4, interval=1) == 0.0  # outside the run
    assert uptime([0.1], start=0, end=0, interval=1) == 0.0


def test_progress_table_renders_partial_status():
    status = {"mode": "decoupled", "rounds": 12, "versions": [3, 4], "tokens_trained": 1000, "tokens_merged": 900.0,
              "wire_bytes": 123456, "learners": [
                  {"id": "learner-0", "state": "live", "speed": 1.0, "step": 10, "loss": 2.5, "tokens_per_second": 4000,
                   "pushes": 9, "applied": 8},
                  {"id": "learner-1", "state": "absent"},  # nothing reported yet
              ]}
    console = Console(record=True, width=160)
    console.print(progress_table(status, 12.0, "budget 120s"))
    text = console.export_text()
    assert "learner-0" in text and "2.500" in text and "absent" in text and "versions 3–4" in text
    assert "120.6 KiB" in text


def test_human_bytes():
    assert human_bytes(512) == "512 B"
    assert human_bytes(3 * 2**20) == "3.0 MiB"
    assert human_bytes(None) == "–"


def test_tokens_are_summed_over_the_lives_of_a_restarted_learner():
    lines = [{"step": 1, "tokens": 10}, {"step": 2, "tokens": 20}, {"step": 1, "tokens": 10}, {"step": 2, "tokens": 20},
             {"step": 3, "tokens": 30}]
    assert tokens_per_life(lines) == [20, 30]
    assert tokens_per_life([]) == []


def steps_every(seconds, start, end, busy_at):
    """Metric lines of one learner stepping every `seconds`, each taking busy_at(t) seconds of compute."""
    n = int((end - start) / seconds)
    return [{"t": start + i * seconds, "busy": busy_at(start + i * seconds)} for i in range(n)]


def test_healthy_rate_ignores_steps_taken_during_and_just_after_faults():
    windows = fault_windows([{"start": 5, "end": 30, "kind": "kill", "target": "b"}], origin=1000)
    # a's steps are fast while b is down (more CPU for a) and slow while b restarts: neither is healthy speed
    busy = lambda t: 0.25 if 1005 <= t < 1030 else (2.0 if 1030 <= t < 1035 else 0.5)
    lines = steps_every(0.5, 1000, 1040, busy)
    assert healthy_rate(lines, windows, tokens_per_step=100) == 200.0
    assert healthy_rate(lines, [], tokens_per_step=100) == 400.0  # the median of all steps is a faulty one
    most_faulty = fault_windows([{"start": 0, "end": 39, "kind": "hang", "target": "b"}], origin=1000)
    assert healthy_rate(lines, most_faulty, 100) == 400.0  # too few healthy steps: all steps' median
    assert healthy_rate([], windows, 100) == 0.0


def test_goodput_is_merged_tokens_over_healthy_capacity_for_the_whole_run():
    assert goodput(15000, {"a": 100.0, "b": 100.0}, wall=100) == 0.75
    assert goodput(0, {}, 100) == 0.0


def test_steps_recomputed_after_a_restart_do_not_advance_the_model():
    lines = [{"t": t, "step": s} for t, s in [(1, 1), (2, 2), (3, 3), (9, 2), (10, 3), (11, 4)]]
    assert new_steps(lines) == [1, 2, 3, 11]
