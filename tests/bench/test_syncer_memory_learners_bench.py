"""benchmarks/syncer/memory_learners.py end to end at a smoke size: a real syncer and real learners over gRPC; what
it reports per number of learners, and its peak before the learners finish within its peak."""

import json
import subprocess

import pytest

from benchmarks import child_env, module_command

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
