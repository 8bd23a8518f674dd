"""Network faults on demand: a TCP proxy between learners and the syncer that adds latency, jitter, bandwidth
caps, dropped connections and partitions, for tests and for `diloco proxy`."""

from diloco.chaos.proxy import FaultProxy, LinkFaults, ProxyThread

__all__ = ["FaultProxy", "LinkFaults", "ProxyThread"]
