"""Prometheus metrics of the syncer, in a registry of its own so several syncers can share a process."""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from diloco.algorithm.codec import CODECS
from diloco.wire.messages import RPC_OF, payload_part, wire_size

MAX_REASONS = 32
"""Distinct `reason` labels of diloco_refusals; later new ones count as "other" (labels must not grow unbounded)."""


def reason_label(reason: str, limit: int = 40) -> str:
    """A short, bounded label for a refusal reason: its text before the first ':' with numbers and quoted values
    left out ("contribution based on version 7 of fragment 3 ..." is "stale"), at most `limit` characters."""
    if reason.startswith("contribution based on version"):
        return "stale"
    text = reason.split(":")[0]
    text = re.sub(r"'[^']*'|\"[^\"]*\"|\d+", "", text)
    return " ".join(text.split())[:limit] or "other"


PER_LEARNER = (
    ("live", "live", "1 while the learner is live, 0 once absent or gone"),
    ("step", "step", "inner steps the learner reports"),
    ("tokens_per_second", "tokens_per_second", "tokens a second the learner reports"),
    ("step_seconds", "step_seconds", "the learner's moving average of its step time"),
    ("staleness", "staleness", "versions its latest accepted contribution was behind"),
    ("pushes", "pushes", "pushes of the learner admitted"),
    ("merged", "merged", "contributions of the learner merged"),
    ("refused", "refused", "pushes of the learner refused"),
    ("last_seen_ago", "last_seen_seconds", "seconds since the learner was last heard from"),
)
"""Per-learner series (labelled by id) taken from /status: field, metric name, help."""


class SyncerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.wire_bytes = Counter("diloco_wire_bytes", "gRPC message bytes to and from learners", ["direction"], registry=r)
        self.wire_parts = Counter(
            "diloco_wire_part_bytes", "gRPC message bytes by call and part: encoded values (payload:<codec>) or "
            "framing (headers, fields, length prefixes)", ["rpc", "part"], registry=r)
        self.pushes = Counter("diloco_pushes", "outer-gradient pushes admitted", registry=r)
        self.refusals = Counter("diloco_refusals", "pushes or requests refused, by reason", ["reason"], registry=r)
        self.rounds = Gauge("diloco_rounds", "rounds closed (merges applied)", registry=r)
        self.version = Gauge("diloco_fragment_version", "current version of each fragment", ["fragment"], registry=r)
        self.live = Gauge("diloco_live_learners", "learners heard from within the absence timeout", registry=r)
        self.tokens_trained = Gauge("diloco_tokens_trained", "tokens trained as accepted pushes back them (what the "
                                    "budget counts)", registry=r)
        self.tokens_claimed = Gauge("diloco_tokens_claimed", "tokens learners' heartbeats claim (nothing backs them)",
                                    registry=r)
        self.tokens_merged = Gauge("diloco_tokens_merged", "tokens whose effect reached the global model", registry=r)
        self.merge_seconds = Histogram(
            "diloco_merge_seconds", "seconds to close a round: merge, outer step, encoding, persisting", registry=r,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0))
        self.core_queue = Gauge("diloco_core_queue_depth", "calls waiting for the syncer's core worker thread",
                                registry=r)
        self.loop_lag = Histogram(
            "diloco_event_loop_lag_seconds", "how late the syncer's event loop wakes from a 0.1 s sleep", registry=r,
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))
        self.heartbeat_seconds = Histogram(
            "diloco_heartbeat_seconds", "seconds the syncer took to record a heartbeat (waiting included)", registry=r,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))
        self.round_contributors = Histogram(
            "diloco_round_contributors", "learners whose contributions a round merged (participation)", registry=r,
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128))
        self.staleness = Histogram(
            "diloco_contribution_staleness", "versions a merged contribution was behind its fragment", registry=r,
            buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16))
        self.round_open_seconds = Histogram(
            "diloco_round_open_seconds", "seconds from a round's first contribution to its close (quorum and grace)",
            registry=r, buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0))
        self.quorum_seconds = Histogram(
            "diloco_round_quorum_seconds", "seconds from a round's first contribution to its quorum", registry=r,
            buckets=(0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0))
        self.rda_vanished = Counter(
            "diloco_rda_vanished", "RDA tensors whose contributions' mean direction vanished in a merge (merged as the "
            "weighted mean, or as 0 with rda_mean_fallback off)", registry=r)
        self.memory = Gauge("diloco_syncer_memory_bytes", "bytes the syncer holds by part (docs/architecture.md, "
                            "Syncer memory), and its resident set (part=rss)", ["part"], registry=r)
        self._reasons: set[str] = set()
        self.per_learner = {
            field: Gauge(f"diloco_learner_{name}", text, ["learner"], registry=r)
            for field, name, text in PER_LEARNER}
        self._learners: set[str] = set()

    def observe_event(self, kind: str, fields: dict) -> None:
        """Participation, staleness and round times from the core's round events."""
        if kind != "round":
            return
        contributors = fields.get("contributors", [])
        self.rda_vanished.inc(fields.get("rda_vanished", 0))
        self.round_contributors.observe(len(contributors))
        for c in contributors:
            self.staleness.observe(c["staleness"])
        if fields.get("open_seconds") is not None:
            self.round_open_seconds.observe(fields["open_seconds"])
        if fields.get("quorum_seconds") is not None:
            self.quorum_seconds.observe(fields["quorum_seconds"])

    def refused(self, reason: str) -> None:
        """Count one refusal under a bounded label (see reason_label)."""
        self._count(reason_label(reason))

    def refused_join(self, reason: str) -> None:
        """Count one refused join under its reason, "join: …", a label bounded already (join_refusals.join_reason)."""
        self._count(reason)

    def _count(self, label: str) -> None:
        if label not in self._reasons:
            if len(self._reasons) >= MAX_REASONS:
                label = "other"
            self._reasons.add(label)
        self.refusals.labels(label).inc()

    def observe_rounds(self, core) -> None:
        self.rounds.set(core.rounds)
        for i, fs in enumerate(core.fragments):
            self.version.labels(str(i)).set(fs.version)

    def observe_status(self, status: dict) -> None:
        self.live.set(sum(1 for learner in status["learners"] if learner["state"] == "live"))
        self.tokens_trained.set(status["tokens_trained"])
        self.tokens_claimed.set(status.get("tokens_claimed", status["tokens_trained"]))
        self.tokens_merged.set(status["tokens_merged"])
        for part, size in status.get("memory", {}).items():
            self.memory.labels(part).set(size)
        seen = set()
        for learner in status["learners"]:
            seen.add(learner["id"])
            for field, gauge in self.per_learner.items():
                value = learner["state"] == "live" if field == "live" else learner.get(field)
                if value is not None:
                    gauge.labels(learner["id"]).set(float(value))
        for gone in self._learners - seen:  # forgotten by the syncer: its series go too (labels stay bounded)
            for gauge in self.per_learner.values():
                try:
                    gauge.remove(gone)
                except KeyError:
                    pass
        self._learners = seen

    def wire_by_direction(self) -> dict[str, int]:
        """Bytes sent to and received from learners (the syncer's view), for /status."""
        return {f"wire_bytes_{d}": int(self.wire_bytes.labels(d)._value.get()) for d in ("sent", "received")}

    def count_message(self, message, direction: str, codec_name: str | None = None) -> None:
        """One gRPC message to or from a learner, by direction and by call and part; `codec_name`: the codec of a
        push's data chunk, named in its stream's header."""
        rpc, carried, payload = payload_part(message)
        self._count_bytes(direction, rpc, wire_size(message), payload, carried or codec_name)

    def count_sent(self, name: str, size: int, payload: int, codec_name: str | None) -> None:
        """One message sent, as gRPC serialized it (syncer/serving/handlers.py): its type's name, its bytes on the
        wire, and the bytes of encoded values it carries in `codec_name`."""
        self._count_bytes("sent", RPC_OF.get(name, "other"), size, payload, codec_name)

    def _count_bytes(self, direction: str, rpc: str, size: int, payload: int, codec_name: str | None) -> None:
        self.wire_bytes.labels(direction).inc(size)
        if payload and codec_name in CODECS:  # an unknown codec name is not a label: those bytes count as framing
            self.wire_parts.labels(rpc, f"payload:{codec_name}").inc(payload)
        else:
            payload = 0
        self.wire_parts.labels(rpc, "framing").inc(size - payload)

    def wire_by_part(self) -> dict[str, dict[str, int]]:
        """Bytes by call, then by part (see `wire_parts`), for /status and the run's report."""
        out: dict[str, dict[str, int]] = {}
        for metric in self.wire_parts.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    out.setdefault(sample.labels["rpc"], {})[sample.labels["part"]] = int(sample.value)
        return out

    def total_wire_bytes(self) -> int:
        return int(sum(self.wire_bytes.labels(d)._value.get() for d in ("sent", "received")))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
