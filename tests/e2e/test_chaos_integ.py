"""`diloco run --chaos`: real OS-level faults against a local cluster; training goes on and nothing is lost."""

import json
import signal
import subprocess
import sys
import time
from collections import defaultdict

import pytest

from diloco.procs import die_with_parent
from liveness import wait_for

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def chaos_run(tmp_path, scenario, *flags, duration=18, until=None):
    """`diloco run --chaos` to its --duration, or with `until(out)`: until that holds, then stopped by SIGTERM
    (which still writes the report), so that a slow machine gets the time it needs."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "diloco", "run", "--model", "tiny", "--learners", "3", "--duration",
           str(duration if until is None else 600), "--chaos", scenario, "--json", "--out", str(out), *flags]
    # the run's processes die with it (diloco.procs); the run itself dies with this test process
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=die_with_parent())
    try:
        if until is not None:
            wait_for(lambda: until(out) or proc.poll() is not None, timeout=300, period=0.5)
            (out / "stopped_at").write_text(str(time.time()))  # what follows is the run's end, not its training
            proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == (0 if until is None else 130), stderr[-3000:]
    return json.loads(stdout), out


def metric_lines(out, learner):
    path = out / "metrics" / f"{learner}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")] if path.exists() else []


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

    def back_at(out) -> float:
        """When learner-1's second life took its first step (inf before)."""
        killed = metric_lines(out, "learner-1")
        lives = [i for i, x in enumerate(killed) if x["step"] == 1]
        return killed[lives[1]]["t"] if len(lives) > 1 else float("inf")

    def trained_together_after_the_return(out) -> bool:
        back = back_at(out)
        return back < float("inf") and all(any(x["t"] >= back + 2.0 for x in metric_lines(out, lid))
                                            for lid in ("learner-0", "learner-1", "learner-2"))

    report, out = chaos_run(tmp_path, str(scenario), "--mode", mode, "--absent-after-seconds", str(absent_after),
                            "--pace", "off", until=trained_together_after_the_return)
    assert [f["kind"] for f in report["chaos"]["faults"]] == ["kill"]
    killed = metric_lines(out, "learner-1")
    lives = [i for i, x in enumerate(killed) if x["step"] == 1]
    down_from = killed[lives[1] - 1]["t"]  # its last step before the kill
    back, stopped = back_at(out), float((out / "stopped_at").read_text())
    restart = next(e["wall"] for e in map(json.loads, (out / "faults.jsonl").read_text().splitlines())
                   if e["event"] == "fault_end")
    for survivor in ("learner-0", "learner-2"):
        times = [x["t"] for x in metric_lines(out, survivor)]
        steps = [b - a for a, b in zip(times, times[1:])]
        # a machine loaded enough may start the survivor too late to step before the kill: then its whole run's steps
        before = [b - a for a, b in zip(times, times[1:]) if b < down_from] or steps
        # steps that ended from the kill until learner-1 was restarted: rounds close without it
        gaps = [b - a for a, b in zip(times, times[1:]) if down_from <= b <= restart]
        # beyond the absence timeout, a few of its own steps: how long a step takes on this machine right now
        allowed = absent_after + max(2.0, 3 * sorted(before)[len(before) // 2])
        assert any(down_from + absent_after + 2.0 <= t <= back for t in times), \
            f"{survivor} took no step once learner-1 was absent"
        assert max(gaps) <= allowed, f"{survivor} stalled {max(gaps):.1f} s (> {allowed:.1f}) after learner-1 was killed"
        # its return: once it has joined, synchronous rounds wait for its first pushes, so a loaded machine's
        # start-up of the restarted process may hold the survivors that long, and no longer (it rejoins in phase)
        returning = [b - a for a, b in zip(times, times[1:]) if restart < b <= stopped]
        assert max(returning, default=0.0) <= allowed + (back - restart), \
            f"{survivor} stalled {max(returning):.1f} s after learner-1 was restarted"
    assert report["final_eval_loss"] < report["initial_eval_loss"]
