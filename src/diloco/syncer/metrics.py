"""Prometheus metrics of the syncer, in a registry of its own so several syncers can share a process."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest


class SyncerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.wire_bytes = Counter("diloco_wire_bytes", "gRPC message bytes to and from learners", ["direction"], registry=r)
        self.pushes = Counter("diloco_pushes", "outer-gradient pushes admitted", registry=r)
        self.refusals = Counter("diloco_refusals", "pushes or requests refused, by reason", ["reason"], registry=r)
        self.rounds = Gauge("diloco_rounds", "rounds closed (merges applied)", registry=r)
        self.version = Gauge("diloco_fragment_version", "current version of each fragment", ["fragment"], registry=r)
        self.live = Gauge("diloco_live_learners", "learners heard from within the absence timeout", registry=r)
        self.tokens_trained = Gauge("diloco_tokens_trained", "tokens learners report having trained on", registry=r)
        self.tokens_merged = Gauge("diloco_tokens_merged", "tokens whose effect reached the global model", registry=r)

    def observe_rounds(self, core) -> None:
        self.rounds.set(core.rounds)
        for i, fs in enumerate(core.fragments):
            self.version.labels(str(i)).set(fs.version)

    def observe_status(self, status: dict) -> None:
        self.live.set(sum(1 for learner in status["learners"] if learner["state"] == "live"))
        self.tokens_trained.set(status["tokens_trained"])
        self.tokens_merged.set(status["tokens_merged"])

    def total_wire_bytes(self) -> int:
        return int(sum(self.wire_bytes.labels(d)._value.get() for d in ("sent", "received")))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
