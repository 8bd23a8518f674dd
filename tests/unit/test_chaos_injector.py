import threading

from diloco.chaos.injector import Injector
from diloco.chaos.fault_schedule import Fault

from liveness import wait_for


class Recorder:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args: self.calls.append((name, *args))


def test_faults_start_and_end_on_ticks_and_are_recorded():
    cluster = Recorder()
    inj = Injector([Fault(1, "kill", "a", 2), Fault(2, "hang", "b", 1), Fault(3, "syncer-crash", "syncer", 0.5),
                    Fault(3, "partition", "c", 4)], cluster)
    for t in (0.5, 1.0, 2.0, 3.0, 3.5, 10):
        inj.tick(t)
    assert cluster.calls == [("kill", "a"), ("pause", "b"), ("restart", "a"), ("resume", "b"), ("kill", "syncer"),
                             ("partition", "c", 4), ("restart", "syncer")]
    assert [(x["kind"], x["start"], x["end"]) for x in inj.timeline] == [
        ("kill", 1.0, 3.0), ("hang", 2.0, 3.0), ("syncer-crash", 3.0, 3.5), ("partition", 3.0, 7.0)]


def test_slow_fault_duty_cycles_the_process_and_finish_resumes_it():
    cluster = Recorder()
    inj = Injector([Fault(0, "slow", "a", 100, factor=0.5)], cluster)
    inj.tick(0)
    wait_for(lambda: sum(c[0] == "pause" for c in cluster.calls) >= 2)  # cycles, on a thread of its own
    inj.finish()
    wait_for(lambda: not [t for t in threading.enumerate() if t.name == "chaos-slow-a"])  # the cycling stopped
    assert cluster.calls[-1] == ("resume", "a")
    assert {c for c in cluster.calls} == {("pause", "a"), ("resume", "a")}


def test_finish_does_not_restart_killed_learners():
    cluster = Recorder()
    inj = Injector([Fault(0, "kill", "a", 100)], cluster)
    inj.tick(0)
    inj.finish()
    inj.tick(200)
    assert cluster.calls == [("kill", "a")]
