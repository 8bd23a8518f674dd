"""The README's own-loop example works against a real syncer, with two learners."""


from diloco import for_mode
from syncers import train_two


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
