"""What `diloco run` tells its user when its figures say the settings did not do what they say: pushes skipped
because H is shorter than a round trip, and a --tokens budget overshot."""

from types import SimpleNamespace

from diloco.run.report import run_warnings


def report(pushes: int, skipped: int, trained: int) -> dict:
    learners = [{"id": f"learner-{i}", "pushes": pushes, "skipped": skipped} for i in range(4)]
    return {"per_learner": learners, "tokens_trained": trained, "config": {"sync_every": 6}}


def test_a_run_whose_pushes_were_mostly_skipped_is_told_to_raise_h():
    (warning, overshoot) = run_warnings(SimpleNamespace(tokens=2_500_000), report(663, 4540, 5_481_472))
    assert "87% of due pushes were skipped" in warning and "H = 6" in warning and "raise --sync-every" in warning
    assert "2.19× the --tokens budget" in overshoot


def test_a_healthy_run_hears_nothing():
    assert run_warnings(SimpleNamespace(tokens=2_500_000), report(597, 12, 2_514_944)) == []
    assert run_warnings(SimpleNamespace(tokens=None), report(597, 12, 9_000_000)) == []  # no budget, no overshoot
    assert run_warnings(SimpleNamespace(tokens=None), {"per_learner": [{"id": "dp"}], "tokens_trained": 1}) == []
