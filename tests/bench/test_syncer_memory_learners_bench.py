"""benchmarks/syncer/memory_learners.py end to end at a smoke size: a real syncer and real learners over gRPC; what
it reports per number of learners, and its peak before the learners finish within its peak."""

import json
import subprocess

import pytest

from benchmarks import child_env, module_command
from benchmarks.syncer.memory_learners import growth_per_six

SCRIPT = module_command("benchmarks.syncer.memory_learners")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_syncers_peak_is_reported_before_and_after_the_learners_finish(tmp_path):
    out = tmp_path / "memory.json"
    proc = subprocess.run([*SCRIPT, "--learners", "1", "3", "--params", "2.4e5", "--steps", "30", "--json", str(out)],
                          env=child_env(), capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    runs = json.loads(out.read_text())["learners"]
    assert [r["learners"] for r in runs] == [1, 3]
    for r in runs:
        assert r["baseline_rss_mib"] <= r["peak_before_finish_mib"] <= r["peak_rss_mib"]
        assert r["pushes"] >= 30 * r["learners"] and r["received_after_join_mib"] > 0  # a push a step, and the flush
        assert {"model", "changes", "open_rounds", "allocator_free"} <= set(r["parts_at_peak_mib"])
        assert r["peak_phase"] in ("join", "steps", "finish") and r["full_answers"] is not None
    assert "before the learners finished" in proc.stdout
    growth = json.loads(out.read_text())["growth_per_six"]
    a, b = runs
    assert growth["peak"] == [round((b["peak_rss_mib"] - a["peak_rss_mib"]) / a["model_mib"] / 2 * 6, 4)]
    assert "six more learners, 1 → 3: peak" in proc.stdout


def run(learners, repeat, peak, before=None):
    return dict(learners=learners, repeat=repeat, peak_rss_mib=peak, peak_before_finish_mib=before or peak,
                model_mib=60.0)


def test_what_six_more_learners_add_is_paired_by_repeat_and_its_median_given():
    growth = growth_per_six([run(8, 0, 430.0), run(14, 0, 431.0), run(20, 0, 436.0, 433.0),
                             run(8, 1, 432.0), run(14, 1, 440.0), run(20, 1, 429.0),
                             run(8, 2, 428.0), run(20, 2, 434.0)])
    assert (growth["from"], growth["to"]) == (8, 20)  # the fewest and the most; 14 plays no part
    assert growth["peak"] == [0.05, -0.025, 0.05] and growth["peak_median"] == 0.05
    assert growth["before_finish"] == [0.025, -0.025, 0.05] and growth["before_finish_median"] == 0.025
    assert growth_per_six([run(8, 0, 430.0), run(8, 1, 431.0)]) is None  # one number of learners: nothing to say
