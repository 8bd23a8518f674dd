"""A learner frozen with SIGSTOP stalls no one; woken with SIGCONT it goes on without corrupting the model."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace

import pytest

from diloco.run.local import TINY
from diloco.train.train_config import TrainConfig
from diloco.train.loop import train_config_to_json

from liveness import Watchdog, wait_for

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


def spawn(args, log):
    return subprocess.Popen([sys.executable, "-m", "diloco", "--log-level", "INFO", *args], stdout=log,
                            stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))


def merged(http_port) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/status", timeout=2) as r:
        return {x["id"]: x["merged"] for x in json.loads(r.read())["learners"]}


def test_sigstop_learner_is_excluded_then_resumes(tmp_path):
    (tmp_path / "train.json").write_text(train_config_to_json(replace(TrainConfig(), model=TINY)))
    log = (tmp_path / "log.txt").open("a")
    syncer = spawn(["syncer", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--state", str(tmp_path / "s"),
                    "--learners", "2", "--fragments", "4", "--sync-every", "8", "--absent-after-seconds", "1.5"], log)
    learners = []
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "s" / "ready.json").exists():
            assert syncer.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        ready = json.loads((tmp_path / "s" / "ready.json").read_text())
        # l0 trains until it is told to leave: were it to finish during the freeze, the model would stop advancing
        # for that reason alone (on an idle machine 500 steps take about as long as the wait for its calm stalls)
        learners += [spawn(["learner", "--syncer", f"127.0.0.1:{ready['grpc_port']}", "--id", f"l{i}", "--shard",
                            str(i), "--num-shards", "2", "--max-steps", str(steps), "--train-config",
                            str(tmp_path / "train.json"), "--summary", str(tmp_path / f"l{i}.json")], log)
                     for i, steps in enumerate((100000, 500))]
        wait_for(lambda: all(merged(ready["http_port"]).get(f"l{i}", 0) > 0 for i in range(2)))  # both training
        watchdog = Watchdog(ready["http_port"])
        # the absence timeout, then a few of the machine's own gaps between advances without any fault
        allowed = 1.5 + max(0.5, 3 * watchdog.calm_stall())
        learners[1].send_signal(signal.SIGSTOP)
        time.sleep(allowed + 2.0)  # l1 frozen longer than the bound: if it held the others, the watchdog sees it
        learners[1].send_signal(signal.SIGCONT)
        watchdog.assert_alive(allowed)
        assert learners[0].poll() is None, "l0 stopped during the freeze: the watchdog measured nothing"
        assert learners[1].wait(120) == 0  # woken, l1 trains on to its last step
        learners[0].send_signal(signal.SIGTERM)  # pushes what it has and leaves
        assert learners[0].wait(60) == 0
    finally:
        for p in learners:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
        syncer.send_signal(signal.SIGTERM)
        try:
            syncer.wait(30)
        except subprocess.TimeoutExpired:
            syncer.kill()
            raise
    final = json.loads((tmp_path / "s" / "syncer.json").read_text())
    states = {x["id"]: x for x in final["learners"]}
    assert states["l1"]["merged"] > 0 and states["l0"]["merged"] > 0
    assert json.loads((tmp_path / "l1.json").read_text())["steps"] == 500
    assert 0 < json.loads((tmp_path / "l0.json").read_text())["steps"] < 100000
