"""Accounting and display helpers of `diloco run`'s report."""

from rich.console import Console

from diloco.run.display import human_bytes, progress_table
from diloco.run.report import uptime


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
    from diloco.run.report import tokens_per_life

    lines = [{"step": 1, "tokens": 10}, {"step": 2, "tokens": 20}, {"step": 1, "tokens": 10}, {"step": 2, "tokens": 20},
             {"step": 3, "tokens": 30}]
    assert tokens_per_life(lines) == [20, 30]
    assert tokens_per_life([]) == []
