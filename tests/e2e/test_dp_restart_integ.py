"""The data-parallel baseline under worker failures: the whole job restarts from its last checkpoint."""

import math
import signal
import time

import pytest

from diloco.baselines.dp import latest_checkpoint, ring_allreduce_bytes
from diloco.run.dp_launch import run_dp
from diloco.cli import build_parser
from diloco.run.local import Progress, RunFailed, make_plan
from diloco.run.report import build_report, read_metrics

pytestmark = pytest.mark.timeout(600)  # a loaded machine can take minutes


def dp_plan(out, steps, pace=None):
    paced = ["--pace", str(pace)] if pace else []
    args = build_parser().parse_args(["run", "--mode", "dp", "--model", "tiny", "--learners", "2", "--steps",
                                      str(steps), "--out", str(out), *paced])
    return make_plan(args)


class KillWorker1:
    """SIGKILLs learner-1 once its metrics show a step >= `after` well past a checkpoint boundary (the worker may
    go on a step or two before the signal lands), so some steps are surely lost. At most `times` kills;
    `after=0` kills as soon as the worker runs."""

    def __init__(self, metrics, after, every, times=1):
        self.metrics, self.after, self.every, self.left = metrics, after, every, times
        self.killed_at = []

    def __call__(self, procs):
        proc = procs["learner-1"]
        if not self.left or proc.poll() is not None:
            return
        lines = read_metrics(self.metrics).get("learner-1", [])
        step = lines[-1]["step"] if lines else 0
        if step >= self.after and (self.after == 0 or 0 < step % self.every < self.every - 3):
            proc.send_signal(signal.SIGKILL)
            self.left -= 1
            self.killed_at.append(step)


@pytest.mark.slow
def test_killed_worker_restarts_the_job_from_its_last_checkpoint(tmp_path):
    # paced, so the half-second ticks see learner-1 between two checkpoints however fast this machine steps
    plan, started = dp_plan(tmp_path / "run", 120, pace=0.1), time.time()
    kill = KillWorker1(plan.out / "metrics", after=40, every=25)
    learners, source = run_dp(plan, Progress(plan, enabled=False), on_tick=kill, checkpoint_every=25)

    assert source["steps"] == 120 and len(kill.killed_at) == 1
    [restart] = source["restarts"]
    killed_at = kill.killed_at[0]
    assert restart["resumed_step"] == killed_at // 25 * 25 >= 25
    assert source["lost_steps"] >= killed_at - restart["resumed_step"] > 0
    assert source["wire_bytes"] == 2 * ring_allreduce_bytes(2, 4 * source["parameters"]) * (120 + source["lost_steps"])
    assert latest_checkpoint(plan.out / "dp" / "checkpoint")[0] == 120
    assert all(x["exit_code"] == 0 and x["steps"] == 120 for x in learners)
    assert (plan.out / "logs" / "learner-1.restart-1.log").exists()
    for lines in read_metrics(plan.out / "metrics").values():
        assert lines[-1]["step"] == 120 and lines[-1]["restarts"] == 1
        first = {x["step"]: x["loss"] for x in lines if x["restarts"] == 0}
        again = {x["step"]: x["loss"] for x in lines if x["restarts"] == 1}
        assert sorted(again) == list(range(restart["resumed_step"] + 1, 121))
        redone = sorted(set(first) & set(again))
        assert redone and all(first[s] == again[s] for s in redone)  # model, optimizer and data resumed exactly

    report = build_report(plan, learners, source, started)
    assert math.isfinite(report["final_eval_loss"]) and report["final_eval_loss"] < report["initial_eval_loss"]
    assert report["rounds"] == 120 and (plan.out / "model.safetensors").exists()
    tokens = [c["tokens_trained"] for c in report["eval_curve"]]
    assert tokens == sorted(tokens)  # snapshots of lost steps were dropped


def test_gives_up_after_max_restarts_naming_the_logs(tmp_path):
    plan = dp_plan(tmp_path / "run", 120)
    kill = KillWorker1(plan.out / "metrics", after=0, every=25, times=2)
    with pytest.raises(RunFailed, match=r"failed 2 times.*max_restarts=1.*learner-1\.restart-1\.log"):
        run_dp(plan, Progress(plan, enabled=False), on_tick=kill, max_restarts=1)
