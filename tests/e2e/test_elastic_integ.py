"""Elastic membership: a learner added to a running run contributes; one removed with SIGTERM leaves cleanly."""

import json
import os
import signal
import subprocess
import sys
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


def learners_in(http_port):
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/status", timeout=2) as r:
        return {x["id"]: x for x in json.loads(r.read())["learners"]}


def test_learner_added_mid_run_contributes_and_sigterm_removes_one_cleanly(tmp_path):
    (tmp_path / "train.json").write_text(train_config_to_json(replace(TrainConfig(), model=TINY)))
    log = (tmp_path / "log.txt").open("a")
    syncer = spawn(["syncer", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--state", str(tmp_path / "s"),
                    "--learners", "2", "--fragments", "4", "--sync-every", "8"], log)
    procs = []
    try:
        wait_for(lambda: (tmp_path / "s" / "ready.json").exists() or syncer.poll() is not None)
        assert syncer.poll() is None
        ready = json.loads((tmp_path / "s" / "ready.json").read_text())

        def learner(i, steps):
            return spawn(["learner", "--syncer", f"127.0.0.1:{ready['grpc_port']}", "--id", f"l{i}", "--shard",
                          str(i), "--num-shards", "3", "--max-steps", str(steps), "--train-config",
                          str(tmp_path / "train.json"), "--summary", str(tmp_path / f"l{i}.json")], log)

        procs += [learner(0, 100000), learner(1, 400)]
        wait_for(lambda: all(learners_in(ready["http_port"]).get(f"l{i}", {}).get("merged", 0) > 0 for i in range(2)))
        watchdog = Watchdog(ready["http_port"])
        # rounds held for l0 until it counted as absent (--absent-after-seconds, 10 s) would exceed this bound; the
        # rest is room for a loaded machine, where a learner's start-up takes CPU from the others for seconds
        allowed = max(5.0, 3 * watchdog.calm_stall())
        procs.append(learner(2, 200))  # a third learner the run was not started with
        wait_for(lambda: learners_in(ready["http_port"]).get("l2", {}).get("merged", 0) > 0)
        procs[0].send_signal(signal.SIGTERM)  # removed: pushes what it has, leaves, exits cleanly
        assert procs[0].wait(60) == 0
        left = learners_in(ready["http_port"])["l0"]
        wait_for(lambda: learners_in(ready["http_port"])["l0"]["state"] == "left")
        for p in procs[1:]:
            assert p.wait(120) == 0
        watchdog.assert_alive(allowed)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        syncer.send_signal(signal.SIGTERM)
        try:
            syncer.wait(30)
        except subprocess.TimeoutExpired:
            syncer.kill()
            raise
    final = {x["id"]: x for x in json.loads((tmp_path / "s" / "syncer.json").read_text())["learners"]}
    assert final["l0"]["state"] == "left" and final["l0"]["merged"] >= left["merged"]
    assert final["l1"]["merged"] > 0 and final["l2"]["merged"] > 0
    removed = json.loads((tmp_path / "l0.json").read_text())
    assert 0 < removed["steps"] < 100000 and removed["flushed"] > 0  # stopped early, its last progress pushed
    for i, steps in ((1, 400), (2, 200)):
        assert json.loads((tmp_path / f"l{i}.json").read_text())["steps"] == steps
