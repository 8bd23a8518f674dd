"""benchmarks/quality/outer_momentum.py end to end: the paper preset's outer momentum at CPU scale. Its Nesterov step on every
round is unstable with K = 1 (how far it swings depends on how the machine's timing fills rounds, so no bound is
asserted on it); what is asserted is ours: the learners' last pushes, merged without the momentum's look-ahead, no
longer move the run's end (they did by +0.220 and +0.071 before)."""

import json
import math
import subprocess

import pytest

from benchmarks import child_env, module_command

SCRIPT = module_command("benchmarks.quality.outer_momentum")


@pytest.mark.slow
def test_the_paper_presets_last_pushes_do_not_move_the_runs_end(tmp_path):
    out = tmp_path / "runs.json"
    proc = subprocess.run([*SCRIPT, "--arms", "paper", "--seeds", "0", "--out", str(tmp_path),
                           "--json", str(out)], env=child_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    dp, arm = (next(r for r in report["runs"] if r["arm"] == name) for name in ("dp", "paper"))
    assert arm["sync"]["preset"] == "paper" and arm["sync"]["momentum_every"] == 1
    assert arm["sync"]["outer_lr"] == 0.7 and arm["sync"]["outer_momentum"] == 0.9
    assert all(math.isfinite(loss) for _, loss in arm["curve"] + dp["curve"])
    # measured after the change: −0.099 … +0.025 over five runs; before it +0.220 and +0.071
    assert arm["final"] - arm["before_finish"] < 0.05, (arm["final"], arm["before_finish"])
    assert report["commit"] and report["settings"]["learners"] == 4
