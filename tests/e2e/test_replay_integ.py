"""`diloco replay` of a real run's tape agrees exactly with the syncer that wrote it: same code, same inputs, same
decisions, however late the syncer woke up on a busy machine (real processes on loopback)."""

import json
import subprocess
import sys

import pytest

from diloco.cli import main
from diloco.syncer.replay import replay, wake_up_latency
from diloco.syncer.observation.tape import read

pytestmark = [pytest.mark.timeout(480), pytest.mark.slow]


def test_an_unmodified_run_replays_with_no_difference_and_its_wake_up_latency_apart(tmp_path, capsys):
    out = tmp_path / "run"
    # a slower third learner: rounds close at their grace window's end (a deadline) as well as when every live
    # learner is in
    proc = subprocess.run([sys.executable, "-m", "diloco", "run", "--model", "tiny", "--learners", "3", "--speeds",
                           "1,1,0.5", "--steps", "40", "--fragments", "4", "--sync-every", "8", "--json", "--out",
                           str(out)], capture_output=True, text=True, timeout=450)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tape = out / "syncer" / "tape.jsonl"
    events = read(tape)
    decided = [e for e in events if e["event"] == "round" and e["decision"]["reason"] not in ("forced", "repeat")]
    assert len(decided) >= 10 and all(e["decision"]["due"] is not None for e in decided)
    assert any(c.get("check") for e in decided for c in e["contributors"])  # pushes let into open rounds
    replayed, differences = replay(events)  # the default: no slack
    assert differences == [] and replayed >= len(decided)
    latency = wake_up_latency(events)
    assert len(latency) == len(decided) and min(latency) >= 0
    assert main(["replay", str(tape)]) == 0
    printed = capsys.readouterr().out
    assert f"{replayed} rounds replayed, 0 differences" in printed and "wake-up latency" in printed
    assert json.loads(proc.stdout)["rounds"] >= len(decided)
