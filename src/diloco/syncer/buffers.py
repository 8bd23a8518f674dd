"""Fragment-sized fp32 buffers kept for reuse by the syncer's hot path (decoded pushes, RDA's running sums).

A large tensor allocated afresh is mapped from the operating system and page-faults on its first write: about
2 GB/s here, against 10+ GB/s for memory written before. Without reuse that was a third of an RDA merge's time
(`benchmarks/syncer/throughput.py`). At most `limit_bytes` of free buffers are kept; the rest is released.
"""

from __future__ import annotations

import threading

import torch


class Buffers:
    def __init__(self, limit_bytes: int = 0):
        self.limit_bytes = limit_bytes
        self._free: dict[int, list[torch.Tensor]] = {}
        self._kept = 0
        self._lock = threading.Lock()

    @property
    def kept_bytes(self) -> int:
        return self._kept

    def take(self, numel: int) -> torch.Tensor:
        """A flat fp32 tensor of `numel` values; its contents are whatever was there."""
        with self._lock:
            free = self._free.get(numel)
            if free:
                self._kept -= numel * 4
                return free.pop()
        return torch.empty(numel, dtype=torch.float32)

    def give(self, t: torch.Tensor | None) -> None:
        """Return a buffer nobody uses any more (kept if it fits under the limit)."""
        if t is None or t.dtype != torch.float32 or t.dim() != 1 or not t.is_contiguous() or t._base is not None:
            return
        size = t.numel() * 4
        with self._lock:
            if self._kept + size <= self.limit_bytes:
                self._free.setdefault(t.numel(), []).append(t)
                self._kept += size
