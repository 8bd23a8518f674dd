"""benchmarks/syncer/load.py end to end at a smoke size: a real syncer, learners in two client processes, one
learner killed and two leaving and coming back; what it reports, and nothing of it left running."""

import json
import subprocess
from pathlib import Path

import pytest
from liveness import wait_for

from benchmarks import child_env, module_command

SCRIPT = module_command("benchmarks.syncer.load")


def running(pid: int) -> bool:
    """Whether a process with this id runs (a zombie does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.slow
@pytest.mark.timeout(1000)  # a busy 2-core machine stretches the start of each process
def test_a_small_real_run_shape_is_measured_and_leaves_nothing_running(tmp_path):
    out = tmp_path / "load.json"
    # --absent-after-seconds 3: the killed learner shows absent well within the 10 s window
    proc = subprocess.run([*SCRIPT, "--learners", "6", "--params", "2e5", "--seconds", "10",
                           "--processes", "2", "--churn-share", "0.34", "--kill-share", "0.17",
                           "--absent-after-seconds", "3", "--max-seconds", "700", "--json", str(out)], env=child_env(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    r = json.loads(out.read_text())
    assert "stopped_early" not in r and r["processes"] == 2
    assert r["joined"] == 6 and r["counts"]["joined"] == 6
    assert r["counts"]["accepted"] > 0 and r["pushes_per_second"] > 0
    assert r["learner_heartbeat"]["count"] > 6 and r["learner_heartbeat"]["p50_ms"] > 0
    assert r["probe_heartbeat"]["count"] > 0
    latency = r["push_to_publish"]
    assert latency["count"] > 0 and 0 < latency["p50_ms"] <= latency["p99_ms"] <= latency["max_ms"]
    assert len(r["churned"]) == 2 and len(r["killed"]) == 1 and len(r["slow"]) == 2
    assert r["churned_rejoined"] == 2
    assert sorted(name for _, name, kind in r["events"] if kind == "rejoined") == sorted(r["churned"])
    assert r["killed_absent_at_end"] == 1
    assert r["learner_states_at_end"][0]["absent"] >= 1
    assert r["killed_noticed_absent_seconds"][r["killed"][0]] is not None
    assert len(r["rss_over_time"]) >= 5 and all(rss[0] > 0 for _, rss in r["rss_over_time"])
    assert r["syncer_peak_rss_bytes"][0] > 0 and r["provenance"]["settings"]["learners"] == 6
    # every push carries bytes of its own: none is refused as a replay of another
    assert "replayed" not in r["refusals"][0] and "count" in r["full_answers"][0]
    # joins send the initial model's digests: at least the first gets none of it (a join of it all: 8 models)
    joins = r["counts"]["joined"] + r["churned_rejoined"]
    assert joins == 8 and r["counts"]["join_bytes"] <= (joins - 1) * r["model_bytes"]
    peak = r["memory_at_peak"][0]  # the syncer's memory by part at its highest RSS
    assert {"model", "changes", "open_rounds", "queued_answers", "receiving"} <= set(peak) and peak["rss"] > 0
    assert len(r["memory_over_time"]) >= 5
    pids = [*r["pids"]["syncers"], *r["pids"]["clients"], r["pids"]["probe"]]
    wait_for(lambda: not any(running(pid) for pid in pids), timeout=60)
