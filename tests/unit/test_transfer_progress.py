"""How far a transfer got: attempts that broken connections start over stall it once none gets further."""

from diloco.learner.transfer_progress import Furthest, Progress


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def attempt(clock, nbytes):
    progress = Progress(stall=5.0, total=1000)
    progress.done, progress.last = nbytes, clock.now
    clock.now += 1.0  # the connection breaks a second after the attempt last moved
    return progress


def test_attempts_that_get_further_go_on_and_one_that_does_not_for_the_stall_time_ends_them():
    clock = Clock()
    furthest = Furthest(stall=5.0, clock=clock)
    assert not furthest.broke(attempt(clock, 300))
    clock.now += 3.0
    assert not furthest.broke(attempt(clock, 500))  # further: its last move counts, not the first attempt's
    assert (furthest.done, furthest.since) == (500, 104.0)
    clock.now += 2.0
    assert not furthest.broke(attempt(clock, 500))  # as far, 4 s after the furthest moved: not yet stalled
    clock.now += 1.0
    assert furthest.broke(attempt(clock, 200))  # 6 s now: nothing got further for more than 5 s
    assert (furthest.done, furthest.breaks) == (500, 4)


def test_attempts_that_never_move_stall_from_the_first_one():
    clock = Clock()
    furthest = Furthest(stall=5.0, clock=clock)
    assert not furthest.broke(attempt(clock, 0))
    clock.now += 4.5
    assert furthest.broke(attempt(clock, 0))
