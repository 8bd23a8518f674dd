"""`diloco run --chaos`: real OS-level faults against a local cluster; training goes on and nothing is lost."""

import json
import subprocess
import sys
from collections import defaultdict

import pytest

from diloco.procs import die_with_parent

pytestmark = pytest.mark.timeout(200)


def chaos_run(tmp_path, scenario, *flags, duration=18):
    out = tmp_path / "run"
    # on a timeout subprocess.run SIGKILLs the run, and the run's processes die with it (diloco.procs); the run
    # itself dies with this test process
    proc = subprocess.run([sys.executable, "-m", "diloco", "run", "--model", "tiny", "--learners", "3", "--duration",
                           str(duration), "--chaos", scenario, "--json", "--out", str(out), *flags],
                          capture_output=True, text=True, timeout=180, preexec_fn=die_with_parent())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout), out


def test_killed_learner_restarts_under_its_id_and_trains_again(tmp_path):
    # a scenario file rather than the kill-one preset: a restarted process needs seconds to start, and the
    # preset's downtime (a fifth of the run) would leave it too little of this short run
    scenario = tmp_path / "kill.json"
    scenario.write_text(json.dumps([{"at": 2, "kind": "kill", "target": "learner-1", "duration": 1}]))
    report, out = chaos_run(tmp_path, str(scenario))
    (fault,) = report["chaos"]["faults"]
    assert fault["kind"] == "kill"
    steps = [json.loads(line)["step"] for line in (out / "metrics" / f"{fault['target']}.jsonl").read_text().splitlines()]
    assert steps.count(1) == 2  # two lives: before the kill and after the restart
    assert all(x["exit_code"] == 0 for x in report["per_learner"])
    assert report["uptime"] >= 0.9 and report["final_eval_loss"] < report["initial_eval_loss"]
    assert (out / "timeline.png").exists()
    # the fault on its tape, read with the syncer's as one
    proc = subprocess.run([sys.executable, "-m", "diloco", "inspect", str(out / "syncer" / "tape.jsonl"),
                           str(out / "faults.jsonl"), "--json"], capture_output=True, text=True, timeout=60)
    summary = json.loads(proc.stdout)
    assert summary["faults"] == [{"kind": "kill", "target": "learner-1", "run_seconds": summary["faults"][0]["run_seconds"],
                                  "duration": 1}]
    assert summary["rounds"] == report["rounds"] and summary["joins"] >= 4  # learner-1 joined twice


def test_syncer_crash_loses_no_published_round(tmp_path):
    report, out = chaos_run(tmp_path, "syncer-crash")
    assert "resumed from" in (out / "logs" / "syncer.log").read_text()
    final = json.loads((out / "syncer" / "syncer.json").read_text())
    versions = defaultdict(list)
    for _, fragment, version, _ in final["round_log"]:
        versions[fragment].append(version)
    # every version of every fragment appears once, in order, across the crash: none published was lost
    assert all(v == list(range(1, len(v) + 1)) for v in versions.values())
    assert [len(versions[f]) for f in sorted(versions)] == final["versions"]
    assert all(x["exit_code"] == 0 for x in report["per_learner"])


def test_chaos_flags_are_checked(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "diloco", "run", "--chaos", "meteor", "--out", str(tmp_path / "r")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown chaos scenario 'meteor'" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "diloco", "run", "--chaos", "kill-one", "--steps", "10",
                           "--out", str(tmp_path / "r2")], capture_output=True, text=True)
    assert proc.returncode == 2 and "--chaos needs a --duration budget" in proc.stderr


@pytest.mark.parametrize("mode", ["diloco", "streaming"])
def test_synchronous_modes_go_on_without_a_killed_learner(tmp_path, mode):
    # K = all: once the killed learner has been silent for --absent-after-seconds, rounds close with the survivors
    absent_after, killed_at, down = 2.0, 3.0, 8.0
    scenario = tmp_path / "kill.json"
    scenario.write_text(json.dumps([{"at": killed_at, "kind": "kill", "target": "learner-1", "duration": down}]))
    # long enough after the restart for the killed learner to start, rejoin and finish on a busy machine
    report, out = chaos_run(tmp_path, str(scenario), "--mode", mode, "--absent-after-seconds", str(absent_after),
                            "--pace", "off", duration=28)
    assert [f["kind"] for f in report["chaos"]["faults"]] == ["kill"]

    def lines(learner):
        return [json.loads(line) for line in (out / "metrics" / f"{learner}.jsonl").read_text().splitlines()]

    killed = lines("learner-1")
    lives = [i for i, x in enumerate(killed) if x["step"] == 1]
    down_from = killed[lives[1] - 1 if len(lives) > 1 else -1]["t"]  # its last step before the kill
    back_at = killed[lives[1]]["t"] if len(lives) > 1 else float("inf")
    for survivor in ("learner-0", "learner-2"):
        times = [x["t"] for x in lines(survivor)]
        # steps that ended from the kill on, learner-1's return included: it rejoins in phase with the survivors
        gaps = [b - a for a, b in zip(times, times[1:]) if b >= down_from]
        assert any(down_from + absent_after + 2.0 <= t <= back_at for t in times), \
            f"{survivor} took no step once learner-1 was absent"
        assert any(t >= back_at + 2.0 for t in times), f"{survivor} took no step after learner-1 rejoined"
        assert max(gaps) <= absent_after + 2.0, f"{survivor} stalled {max(gaps):.1f} s after learner-1 was killed"
    assert back_at < float("inf") and killed[-1]["t"] >= back_at + 2.0, "learner-1 did not train after rejoining"
    assert report["final_eval_loss"] < report["initial_eval_loss"]
