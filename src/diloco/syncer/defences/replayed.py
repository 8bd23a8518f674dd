"""Verbatim replays: a push whose payload repeats, byte for byte, one the syncer accepted for the same fragment.

Honest learners never send the same bytes twice for a fragment: each push carries new progress (a resent push
keeps its sequence number and is recognised as a duplicate before this). A credential holder replaying its own old
pushes, or anyone replaying a captured one, would have stale steps merged as new. Not judged here: a payload of all
zeros (a frozen fragment, a free-rider; it has no weight anyway), and one of fewer than MIN_VALUES values, whose int4
levels and scales can come out the same twice when training moves slowly (a test model's 20-value layer did). Memory:
WINDOW digests of 16 bytes per fragment; not persisted (after a restart a learner may resend what the crash lost)."""

from __future__ import annotations

import hashlib
from collections import OrderedDict

MIN_VALUES = 1024
"""Fragments with fewer values are not judged (see above)."""
WINDOW = 256
"""Accepted payloads per fragment whose digests are kept: with H steps between a learner's pushes of a fragment,
the last WINDOW / M pushes of each of M learners."""


def digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


class RecentPayloads:
    """Digests of a fragment's last WINDOW accepted payloads."""

    def __init__(self) -> None:
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self._seen

    def add(self, key: bytes) -> None:
        self._seen[key] = None
        self._seen.move_to_end(key)
        while len(self._seen) > WINDOW:
            self._seen.popitem(last=False)
