"""Payloads the agreement test keeps until their round closes (syncer/defences/agreement.py), to fold a contribution
in anew if the test scales it down: in memory up to a budget, beyond it in one unnamed file per fragment.

Every open round keeps one payload per contribution (int4: an eighth of its fragment), so kept in memory they grow
with the learners: 785 MiB at 64 learners of a 124M model. Most are never read again (the test scales nothing down
in an honest round), so beyond the budget they are written to a file, which the page cache holds while memory is
free and the kernel may write out when it is not. A fragment's file is emptied when its round closes. A payload read
back is checked against its CRC-32 when it is decoded, as one from the wire is: a disk that lies is caught there.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from diloco.algorithm.codec import Encoded

log = logging.getLogger("diloco.syncer")


@dataclass(frozen=True)
class Spilled:
    """Where a kept payload's bytes are: `size` bytes at `offset` of its fragment's file."""

    fragment: int
    offset: int
    size: int
    codec: str
    numel: int
    checksum: int


class KeptPayloads:
    """`keep` a payload for a fragment's open round, `load` it back, `release` the fragment's when its round closes.
    `share`: bytes kept in memory at once, as a share of the model's fp32 bytes given to `keep` (None: no bound);
    `folder`: where the files are made (unnamed: nothing is left behind, even after a crash; None: the system's
    temporary folder). Called from the core worker; the counts are read from any thread."""

    def __init__(self, share: float | None = None, folder: Path | None = None):
        self.share, self.folder = share, folder
        self.in_memory = 0
        """Bytes of payloads kept in memory."""
        self.on_disk = 0
        """Bytes of payloads in the files now."""
        self.spilled = 0
        """Payloads ever written to the files."""
        self._memory: dict[int, int] = {}
        self._files: dict[int, object] = {}
        self._lock = threading.Lock()
        self._warned = False

    def keep(self, fragment: int, payload: Encoded, model_bytes: int,
             replacing: Encoded | Spilled | None = None) -> Encoded | Spilled:
        """Keep `payload`; `replacing`: what was kept for the push it replaces (`repeat_push` replace), which no
        round reads again: one kept in memory no longer counts toward the budget (one on disk stays in its file
        until the round closes)."""
        size = len(payload.data)
        with self._lock:
            if isinstance(replacing, Encoded):
                self.in_memory -= len(replacing.data)
                self._memory[fragment] = self._memory.get(fragment, 0) - len(replacing.data)
            if self.share is None or self.in_memory + size <= self.share * model_bytes:
                return self._in_memory(fragment, payload)
        try:
            file = self._files.get(fragment)
            if file is None:
                file = self._files[fragment] = tempfile.TemporaryFile(dir=self.folder)
            offset = file.seek(0, os.SEEK_END)
            file.write(payload.data)
            file.flush()
        except OSError as e:  # a full or failing disk: memory it is, and the operator is told
            if not self._warned:
                log.warning("cannot keep the agreement test's payloads on disk in %s (%s); keeping them in memory",
                            self.folder or tempfile.gettempdir(), e)
                self._warned = True
            with self._lock:
                return self._in_memory(fragment, payload)
        with self._lock:
            self.on_disk += size
            self.spilled += 1
        return Spilled(fragment, offset, size, payload.codec, payload.numel, payload.checksum)

    def _in_memory(self, fragment: int, payload: Encoded) -> Encoded:
        """Count `payload` as kept in memory for `fragment` (under the lock)."""
        self.in_memory += len(payload.data)
        self._memory[fragment] = self._memory.get(fragment, 0) + len(payload.data)
        return payload

    def load(self, kept: Encoded | Spilled) -> Encoded:
        """The payload as it was kept (a spilled one read back; its checksum is verified when it is decoded)."""
        if isinstance(kept, Encoded):
            return kept
        file = self._files[kept.fragment]
        file.seek(kept.offset)
        data = bytearray(kept.size)
        got = file.readinto(data)
        if got != kept.size:  # a file cut short under us: the decode refuses the payload by its size
            data = data[:got]
        return Encoded(kept.codec, kept.numel, data, kept.checksum)

    def release(self, fragment: int) -> None:
        """The fragment's round closed: what it kept is no longer needed (its file is emptied, kept for the next)."""
        with self._lock:
            self.in_memory -= self._memory.pop(fragment, 0)
            file = self._files.get(fragment)
            if file is not None:
                self.on_disk -= file.seek(0, os.SEEK_END)
        if file is not None:
            file.truncate(0)

    def close(self) -> None:
        with self._lock:
            files, self._files = list(self._files.values()), {}
        for file in files:
            file.close()
