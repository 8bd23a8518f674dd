"""Pacing: each step padded to pace / speed, overruns counted; --pace parsed with clear errors."""

import time

import pytest

from diloco.run.accounting import goodput, paced_rate
from diloco.run.pacing import parse_pace
from diloco.train.loop import StepClock


def test_a_paced_step_takes_pace_over_speed_and_a_slow_one_is_counted_as_an_overrun():
    clock = StepClock(speed=0.5, pace=0.02)
    started = clock.start()
    assert clock.finish(started) >= 0.04 and clock.overruns == 0
    started = clock.start()
    time.sleep(0.05)  # compute longer than the 0.04 s allowed
    assert clock.finish(started) < 0.09 and clock.overruns == 1


def test_goodput_over_allocated_capacity_cannot_exceed_one_for_work_a_pace_allows():
    rates = {"a": paced_rate(1024, 1.0, 0.1), "b": paced_rate(1024, 0.25, 0.1)}
    assert rates == {"a": 10240.0, "b": 2560.0}
    wall = 30.0
    most = sum(rates.values()) * wall  # every allocated step taken and merged
    assert goodput(most, rates, wall) == 1.0


@pytest.mark.parametrize("text, value", [(None, None), ("auto", "auto"), ("off", "off"), ("0.25", 0.25)])
def test_pace_values(text, value):
    assert parse_pace(text) == value


@pytest.mark.parametrize("text", ["0", "-1", "fast", "inf", "nan"])
def test_bad_pace_is_refused_clearly(text):
    with pytest.raises(ValueError, match="--pace must be a positive number of seconds, auto or off"):
        parse_pace(text)
