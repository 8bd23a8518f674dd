"""The Grafana dashboard in docs/ asks only for metrics the syncer serves."""

import json
import pathlib
import re

from diloco.syncer.observation.metrics import SyncerMetrics

DASHBOARD = pathlib.Path(__file__).resolve().parents[2] / "docs" / "grafana" / "diloco-syncer.json"


def test_every_metric_the_dashboard_queries_is_served():
    metrics = SyncerMetrics()
    metrics.wire_bytes.labels("sent").inc()
    metrics.refused("stale")
    metrics.version.labels("0").set(1)
    metrics.observe_event("round", {"contributors": [{"staleness": 0}], "open_seconds": 0.1, "quorum_seconds": 0.0})
    served = set(re.findall(r"^(diloco_\w+?)(?:\{|\s)", metrics.exposition().decode(), re.M))
    queries = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    wanted = {name for q in queries for name in re.findall(r"diloco_\w+", q)}
    assert len(wanted) >= 15 and wanted <= served, sorted(wanted - served)
