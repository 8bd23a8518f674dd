"""The syncer's history for the dashboard (syncer/observation/history.py): bounded whatever the run's length, thinned so the
whole run stays covered, served at /history behind the same guard as /status."""

import json
import socket
import urllib.error
import urllib.request

import pytest

from diloco import ServerOptions, SyncerThread, for_mode
from diloco.syncer.observation import annotations
from diloco.syncer.observation.history import History, Series
from liveness import wait_for
from fakes import learner, status_at


def test_a_series_stays_bounded_and_thinning_keeps_first_newest_and_time_order():
    series = Series(("y",), cap=100)
    for i in range(100_000):
        before = series.thinned
        kept = series.add(float(i), float(i), i)
        assert len(series) <= 100
        if series.thinned > before:  # just thinned: the first point and the one just added are still there
            assert series.rows[0][1] == 0.0 and series.rows[-1][1] == float(i) and kept
    t = series.columns()["t"]
    assert t[0] == 0.0 and t[-1] > 99_999.0 - series.every  # the whole run covered, at a coarser resolution
    assert t == sorted(t) and len(set(t)) == len(t)
    assert series.thinned >= 10 and len(t) > 30
    gaps = [b - a for a, b in zip(t, t[1:])]
    assert max(gaps[:-1]) <= 4 * min(gaps[:-1])  # evenly spread: new points come no closer than the thinned ones
    assert series.columns(since=99_000.0)["t"] == [x for x in t if x > 99_000.0]


def test_a_point_out_of_time_order_goes_in_its_place():
    series = Series(("y",), cap=10)
    for added, t in enumerate((1.0, 3.0, 2.0, 5.0, 0.5)):
        series.add(float(added), t, t)
    assert series.columns()["t"] == [0.5, 1.0, 2.0, 3.0, 5.0]
    assert series.columns(since=2.5)["t"] == [0.5, 5.0]  # by when they were added (the cursor of ?since=)


def test_history_samples_every_interval_and_stays_bounded_over_a_long_run():
    history = History(every=2.0, max_samples=50, max_learner_points=20, max_learners=3)
    taken = [history.observe(status_at(0.5 * i, learners=[learner(f"l{k}", i if k >= 2 else 0) for k in range(5)]))
             for i in range(20_000)]
    assert taken[:5] == [True, False, False, False, True]  # every 2 s of a status refreshed every 0.5 s
    answer = json.loads(json.dumps(history.json(), allow_nan=False))  # strict JSON
    samples = answer["samples"]
    assert 20 <= len(samples["t"]) <= 50 and samples["t"][0] == 0.0 and samples["t"] == sorted(samples["t"])
    assert samples["t"][-1] >= 0.5 * 19_999 - answer["every"]  # up to the end of the run
    assert samples["tokens_trained"] == [int(10 * t) for t in samples["t"]]
    assert set(answer["learners"]) == {"l2", "l3", "l4"}  # the three that moved most recently: l0 and l1 stopped
    for cols in answer["learners"].values():
        assert 0 < len(cols["t"]) <= 20 and cols["t"] == sorted(cols["t"])
        assert set(cols) == {"t", "step", "loss", "tokens_per_second"}
    assert answer["generation"] > 0 and answer["now"] == samples["t"][-1]
    assert answer["bounds"] == {"samples": 50, "learner_points": 20, "learners": 3, "global_eval": 1000,
                                "faults": 1000}


def test_more_moving_learners_than_the_bound_do_not_push_each_other_out():
    history = History(every=1.0, max_learners=3)
    for i in range(50):
        history.observe(status_at(float(i), learners=[learner(f"l{k}", i) for k in range(5)]))
    answer = history.json()
    assert len(answer["learners"]) == 3 and all(len(c["t"]) == 50 for c in answer["learners"].values())
    assert answer["generation"] == 2  # the two dropped on the first sample, never taken back while they move


def test_history_adds_a_learner_point_only_when_its_step_moved_and_takes_each_held_out_loss_once():
    history = History(every=1.0)
    evals = []
    for i in range(10):
        if i in (2, 5):
            evals.append({"kind": "eval", "loss": 3.0 - i / 10, "seconds": i - 0.5, "wall": 1000.0 + i})
        steps = {"a": min(i, 4), "b": i}  # a stops at step 4
        history.observe(status_at(float(i), learners=[learner(n, s) for n, s in steps.items()],
                                  rounds=[(i - 0.2, 0, i, 2)] if i % 2 else [], evals=evals))
    answer = history.json()
    assert answer["learners"]["a"]["t"] == [0.0, 1.0, 2.0, 3.0, 4.0]  # no flat line after it stopped
    assert answer["learners"]["b"]["step"] == list(range(10))
    assert answer["global_eval"] == {"t": [1.5, 4.5], "loss": [2.8, 2.5], "tokens_trained": [None, None]}
    assert answer["samples"]["contributors"] == [None, 2.0] * 5
    later = history.json(since=7.0)  # what a page that read up to 7 s adds
    assert later["samples"]["t"] == [8.0, 9.0] and later["learners"] == {"b": later["learners"]["b"]}
    assert later["learners"]["b"]["t"] == [8.0, 9.0] and later["global_eval"]["t"] == []


def test_faults_go_on_the_syncers_time_axis_once_each_and_the_latest_are_kept():
    history = History(every=1.0, max_faults=10)
    faults = []
    for i in range(40):
        if i % 2:  # the harness's seconds count from the run's first trained step: another origin than the syncer's
            faults.append({"kind": "fault", "event": "start" if i % 4 == 1 else "end", "fault": "kill",
                           "target": f"learner-{i % 3}", "seconds": i - 30.0, "duration": 2.0, "wall": 1000.0 + i - 0.5})
        history.observe(status_at(float(i), faults=faults[-5:]))  # /status lists only the latest ones
        if i == 3:
            assert history.json()["faults"] == {"t": [0.5, 2.5], "event": ["start", "end"], "fault": ["kill", "kill"],
                                                "target": ["learner-1", "learner-0"], "duration": [2.0, 2.0]}
    answer = history.json()
    t = answer["faults"]["t"]
    assert t == [20.5 + 2 * k for k in range(10)]  # the latest ten, each once: no event of them thinned away
    assert answer["faults"]["event"] == ["start", "end"] * 5 and answer["faults"]["target"][-1] == "learner-0"
    assert answer["bounds"]["faults"] == 10 and answer["generation"] == 10  # a page holding dropped ones reloads
    assert history.json(since=36.0)["faults"]["t"] == [36.5, 38.5]
    unplaced = History(every=1.0)  # a fault without the syncer's time of hearing it cannot be placed
    unplaced.observe(status_at(1.0, faults=[{"event": "start", "fault": "kill", "target": "x", "seconds": 1.0}]))
    assert unplaced.json()["faults"]["t"] == []


def get(url: str, token: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def own_address() -> str | None:
    """This machine's address on its default route (not loopback), if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_history_is_served_with_the_samples_taken_and_guarded_like_status():
    address = own_address()
    if address is None:
        pytest.skip("this machine has no address beyond loopback to read /history from")
    syncer = SyncerThread(for_mode("decoupled", 1, fragments=2, sync_every=4),
                          ServerOptions(listen="127.0.0.1:0", http=f"{address}:0", token="run-secret",
                                        status_token="look"))
    try:
        base = f"http://{address}:{syncer.status['http_port']}"
        assert get(base + "/history")[0] == 401  # beyond loopback, like /status
        assert get(base + "/history", token="wrong")[0] == 401
        assert get(base + "/history?since=0", token="nope")[0] == 401
        assert annotations.post(f"{address}:{syncer.status['http_port']}",
                                {"kind": "eval", "loss": 2.5, "seconds": 0.25}, token="run-secret") is None

        def history(query: str = "") -> dict:
            code, body = get(base + "/history" + query, token="look")
            assert code == 200, body
            return json.loads(body)

        wait_for(lambda: len(history()["samples"]["t"]) >= 3 and history()["global_eval"]["t"], timeout=30)
        whole = history()
        assert whole["samples"]["t"] == sorted(whole["samples"]["t"]) and whole["samples"]["t"][0] < 1.5
        assert whole["global_eval"] == {"t": [0.25], "loss": [2.5], "tokens_trained": [None]}
        assert whole["started_unix"] == syncer.status["started_unix"] and whole["since"] is None
        assert b"run-secret" not in get(base + "/history", token="look")[1]
        assert get(base + "/history", token="run-secret")[0] == 200  # the run token reads it too
        cursor = whole["samples"]["t"][1]
        later = history(f"?since={cursor}")
        assert later["samples"]["t"] and all(t > cursor for t in later["samples"]["t"])
        assert later["global_eval"]["t"] == [] and later["since"] == cursor
        assert get(base + "/history?since=soon", token="look")[0] == 400
        assert get(base + "/history?since=nan", token="look")[0] == 400
    finally:
        syncer.stop()
