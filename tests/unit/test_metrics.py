"""The syncer's Prometheus metrics: per-learner series follow the learners /status lists, and go with them."""

from prometheus_client.parser import text_string_to_metric_families

from diloco.syncer.observation.metrics import SyncerMetrics


def status(*learners):
    return {"learners": list(learners), "tokens_trained": 0, "tokens_merged": 0}


def learner(lid, state="live", **fields):
    return {"id": lid, "state": state, "step": 10, "tokens_per_second": 500.0, "step_seconds": 0.1, "staleness": 1,
            "pushes": 7, "merged": 6, "refused": 1, "last_seen_ago": 0.2, **fields}


def samples(metrics) -> dict:
    out = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for s in family.samples:
            if "learner" in s.labels:
                out[(s.name, s.labels["learner"])] = s.value
    return out


def test_each_learner_has_its_series_and_a_forgotten_one_loses_them():
    m = SyncerMetrics()
    m.observe_status(status(learner("a"), learner("b", state="absent", refused=4, step=3)))
    got = samples(m)
    assert got[("diloco_learner_live", "a")] == 1 and got[("diloco_learner_live", "b")] == 0
    assert got[("diloco_learner_refused", "b")] == 4 and got[("diloco_learner_step", "b")] == 3
    assert got[("diloco_learner_tokens_per_second", "a")] == 500 and got[("diloco_learner_staleness", "a")] == 1
    m.observe_status(status(learner("a", tokens_per_second=None)))
    got = samples(m)
    assert not any(lid == "b" for _, lid in got)
    assert got[("diloco_learner_tokens_per_second", "a")] == 500  # not reported this time: the last value stays
