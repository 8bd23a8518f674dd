"""The README's own-loop example works against a real syncer, with two learners."""

import importlib.util
import pathlib
import threading

from diloco import ServerOptions, SyncerThread, for_mode

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "own_loop.py"


def train_two(cfg, steps: int):
    """The example as two learners, alice and bob, against a syncer with `cfg`: (their Learners, its final status)."""
    spec = importlib.util.spec_from_file_location("own_loop", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    syncer = SyncerThread(cfg, ServerOptions(listen="127.0.0.1:0", http=None))
    done = {}
    try:
        threads = [threading.Thread(target=lambda i=i: done.update({i: example.main(syncer.address, i, steps=steps)}))
                   for i in ("alice", "bob")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        status = syncer.stop()
    return done, status


def test_own_loop_example_trains_two_learners_against_a_syncer():
    done, status = train_two(for_mode("decoupled", 2, fragments=2, sync_every=4), steps=40)
    assert len(done) == 2
    for learner in done.values():
        # H = 4, P = 2: a push every second schedule position, each sent or skipped (its predecessor in flight);
        # 40 steps pass 40 positions, give or take the shifts that keep the learner in phase with the other
        assert learner.step_count == 40 and abs(learner.schedule_position - 40) <= 8
        assert learner.pushes - learner.flushed + learner.skipped == learner.schedule_position // 2
        assert learner.pushes >= 2 and learner.applied >= 1
    assert status["rounds"] >= 2 and min(status["versions"]) >= 1
