"""The dashboard's history on disk (syncer/at_rest/history_file.py): a restarted syncer's charts go on from where they were,
and a file of another run, or one that a disk or a hand changed, is not used."""

import copy
import json
import urllib.request

import pytest

from diloco import ServerOptions, SyncerThread, for_mode
from diloco.syncer.at_rest import history_file
from diloco.syncer.observation.history import History
from liveness import wait_for
from syncers import trained_learner
from fakes import learner, status_at

STARTED = 1000.0  # status_at's started_unix


def a_history() -> History:
    """A history with every kind of series, thinned, and a learner dropped for newer ones."""
    history = History(every=1.0, max_samples=20, max_learners=2, max_faults=4)
    for i in range(60):
        evals = [{"kind": "eval", "loss": 3.0, "seconds": 5.5, "wall": STARTED + 6}] if i >= 6 else []
        faults = [{"event": "start", "fault": "kill", "target": f"learner-{k}", "duration": 2.0,
                   "wall": STARTED + k} for k in range(min(i, 6))]
        history.observe(status_at(float(i), learners=[learner(f"l{k}", i) for k in range(3 if i < 30 else 2)],
                                  evals=evals, faults=faults))
    return history


def saved(tmp_path, history: History) -> dict:
    history_file.save(tmp_path / "history.json", history_file.dump(history))
    return json.loads((tmp_path / "history.json").read_text())


def test_a_saved_history_loads_as_it_was_and_goes_on(tmp_path):
    history = a_history()
    before = history.json()
    assert before["generation"] > 0 and len(before["learners"]) == 2 and len(before["faults"]["t"]) == 4
    saved(tmp_path, history)
    again = History(every=1.0, max_samples=20, max_learners=2, max_faults=4)
    assert history_file.load(tmp_path / "history.json", again, STARTED) is None
    assert again.json() == before  # every point, its cursor (`since`) and the generation a page holds
    assert again.json(since=50.0) == history.json(since=50.0)
    assert not again.observe(status_at(59.5)) and again.observe(status_at(60.0))  # the spacing goes on
    assert again.json()["samples"]["t"][-1] == 60.0


def test_no_file_leaves_the_history_empty(tmp_path):
    history = History()
    assert history_file.load(tmp_path / "history.json", history, STARTED) is None
    assert history.json()["samples"]["t"] == [] and history.last is None


def set_in(data: dict, path: tuple, value) -> dict:
    data = copy.deepcopy(data)
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return data


BROKEN = {
    "another run": lambda d: set_in(d, ("started_unix",), STARTED + 1),
    "another format": lambda d: set_in(d, ("format",), 2),
    "a count that is a bool": lambda d: set_in(d, ("forgotten",), True),
    "a negative time": lambda d: set_in(d, ("samples", "rows", 0, 1), -1.0),
    "rows out of time order": lambda d: set_in(d, ("samples", "rows", 1, 1), 0.0) if d["samples"]["rows"][0][1] > 0
    else set_in(d, ("samples", "rows", 0, 1), 1e6),
    "a string for a number": lambda d: set_in(d, ("samples", "rows", 0, 2), "12"),
    "a short row": lambda d: set_in(d, ("evals", "rows", 0), [1.0, 2.0]),
    "more rows than the bound": lambda d: set_in(d, ("samples", "rows"), d["samples"]["rows"] * 3),
    "more learners than the bound": lambda d: set_in(d, ("learners",), d["learners"] * 2),
    "a learner id that is a path": lambda d: set_in(d, ("learners", 0, 0), "../l0"),
    "a learner twice": lambda d: set_in(d, ("learners", 1, 0), d["learners"][0][0]),
    "a fault event of no kind": lambda d: set_in(d, ("faults", "rows", 0, 2), "boom"),
    "markup for a fault's name": lambda d: set_in(d, ("faults", "rows", 0, 3), "<script>"),
    "no samples": lambda d: {k: v for k, v in d.items() if k != "samples"},
    "not an object": lambda d: [d],
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_file_that_fails_a_check_is_not_used(tmp_path, case):
    data = BROKEN[case](saved(tmp_path, a_history()))
    (tmp_path / "history.json").write_text(json.dumps(data))
    history = History(every=1.0, max_samples=20, max_learners=2, max_faults=4)
    problem = history_file.load(tmp_path / "history.json", history, STARTED)
    assert problem and str(tmp_path / "history.json") in problem
    assert history.json() == History(every=1.0, max_samples=20, max_learners=2, max_faults=4).json()  # untouched


@pytest.mark.parametrize("text", ["", "{", '{"format": 1, "last": NaN}', "\udcff"])
def test_a_file_that_is_not_json_is_not_used(tmp_path, text):
    (tmp_path / "history.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    history = History()
    assert "cannot be read" in history_file.load(tmp_path / "history.json", history, STARTED)
    assert history.last is None


def read_history(syncer: SyncerThread) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{syncer.status['http_port']}/history", timeout=5) as r:
        return json.loads(r.read())


def test_a_restarted_syncer_serves_the_charts_of_its_run_from_the_start(tmp_path):
    cfg = for_mode("decoupled", 1, fragments=2, sync_every=4)
    options = ServerOptions(listen="127.0.0.1:0", http="127.0.0.1:0", out=tmp_path / "syncer")
    syncer = SyncerThread(cfg, options)
    try:
        trainer = trained_learner(syncer.address, "a", steps=100, pause=0.05)  # 5 s or more: samples every 2 s
        wait_for(lambda: len(read_history(syncer)["learners"].get("a", {}).get("t", [])) >= 2, timeout=30)
        trainer.close()
    finally:
        syncer.stop()
    before = json.loads((tmp_path / "syncer" / "history.json").read_text())  # written at shutdown
    first = [row[1] for row in before["samples"]["rows"]]
    syncer = SyncerThread(cfg, options)  # the same state folder: the run resumes
    try:
        resumed = read_history(syncer)
        assert resumed["started_unix"] == before["started_unix"]
        assert resumed["samples"]["t"][:len(first)] == first  # the charts from the run's start
        assert len(resumed["learners"]["a"]["t"]) >= 2
        wait_for(lambda: read_history(syncer)["samples"]["t"][-1] > first[-1], timeout=30)  # and on, the same axis
    finally:
        syncer.stop()
