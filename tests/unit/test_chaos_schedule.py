import json

import pytest

from diloco.chaos.fault_schedule import PRESETS, Fault, load, preset

LEARNERS = ["learner-0", "learner-1", "learner-2", "learner-3"]


@pytest.mark.parametrize("name", PRESETS)
def test_presets_are_seeded_and_reproducible(name):
    a, b = load(name, 100, LEARNERS, seed=3), load(name, 100, LEARNERS, seed=3)
    assert a == b and a and all(0 <= f.at < 100 for f in a)


def test_rolling_kills_take_each_learner_down_once_for_a_fifth_of_the_run():
    faults = preset("rolling-kills", 100, LEARNERS)
    assert sorted(f.target for f in faults) == sorted(LEARNERS)
    assert all(f.kind == "kill" and f.duration == 20 for f in faults)
    assert all(b.at > a.at for a, b in zip(faults, faults[1:]))


def test_random_mode_follows_its_mean_time_between_failures():
    faults = preset("random", 10_000, LEARNERS, seed=1, mtbf=100)
    assert 70 <= len(faults) <= 110  # ≈ 0.9·10000/100 = 90 expected


def test_scenario_file(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps([{"at": 5, "kind": "hang", "target": "learner-1", "duration": 2},
                                {"at": 1, "kind": "syncer-crash", "target": "syncer", "duration": 3}]))
    faults = load(str(path), 60, LEARNERS)
    assert [f.kind for f in faults] == ["syncer-crash", "hang"]


@pytest.mark.parametrize("items, message", [
    ([{"at": 1, "kind": "explode", "target": "learner-0", "duration": 1}], "unknown fault kind"),
    ([{"at": 1, "kind": "kill", "target": "learner-9", "duration": 1}], "unknown learner"),
    ([{"at": 1, "kind": "kill", "target": "syncer", "duration": 1}], "cannot target"),
    ([{"at": 1, "kind": "kill", "target": "learner-0", "duration": 0}], "durations > 0"),
    ([{"when": 1}], "expected a JSON list of faults"),
])
def test_bad_scenarios_are_refused_clearly(tmp_path, items, message):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(items))
    with pytest.raises(ValueError, match=message):
        load(str(path), 60, LEARNERS)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown chaos scenario 'meteor'"):
        load("meteor", 60, LEARNERS)
    with pytest.raises(ValueError, match="slow factor"):
        Fault(1, "slow", "learner-0", 1, factor=2)
