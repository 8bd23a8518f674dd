"""Reading --credentials again while the syncer runs, so that a credential can be revoked without a restart.

The file is looked at once a second (its device, inode, size and modification time: one stat) and read again once
a change has held still for a look, so that a file caught half-written is not taken; SIGHUP reads it at once. A file
that cannot be read or parsed leaves the credentials in force as they were (logged); a good one replaces them, and
the sessions it no longer vouches for are closed (`SyncerService.use_credentials`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path

from diloco.syncer.defences.credentials import Credentials, CredentialsError

log = logging.getLogger("diloco.syncer")
CHECK_SECONDS = 1.0
"""How often the file is looked at: a revoked credential's sessions close within about two of these."""


def signature(path: Path) -> tuple | None:
    """What a change of the file changes (None: it cannot be looked at). An edit that keeps all four (a rewrite
    in place of the same size with its time put back) is read on SIGHUP."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class CredentialsWatch:
    """`apply(credentials, why)` (a coroutine) is awaited with each good reading. Event loop only."""

    def __init__(self, path: Path, apply):
        self.path, self.apply = Path(path), apply
        self.seen = signature(self.path)
        """The signature of the file as last read (or found unreadable)."""
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()

    async def reload(self, why: str) -> bool:
        """Read the file now; True when its credentials are now in force."""
        async with self._lock:
            before = signature(self.path)
            try:
                credentials = await asyncio.to_thread(Credentials.load, self.path)
            except CredentialsError as e:
                self.seen = before
                log.error("credentials not reloaded (%s): %s; the ones in force stay so", why, e)
                return False
            if signature(self.path) != before:  # changed while read: the next look reads it again
                return False
            self.seen = before
            await self.apply(credentials, why)
            return True

    async def watch(self, every: float = CHECK_SECONDS) -> None:
        """Until cancelled: read the file again after a change that held still for one look."""
        pending = None  # (signature,) of a change the last look found
        while True:
            await asyncio.sleep(every)
            now = signature(self.path)
            if now == self.seen:
                pending = None
            elif pending == (now,):
                pending = None
                try:
                    await self.reload("the file changed")
                except Exception as e:  # a bug, not the file: say so and keep watching
                    log.error("reloading the credentials failed: %r", e)
            else:
                pending = (now,)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Watch the file, and read it on SIGHUP (from the main thread only: elsewhere, as in tests, changes alone)."""
        self._spawn(self.watch())
        try:
            loop.add_signal_handler(signal.SIGHUP, lambda: self._spawn(self.reload("SIGHUP")))
        except (RuntimeError, ValueError):
            pass

    def stop(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            loop.remove_signal_handler(signal.SIGHUP)
        except (RuntimeError, ValueError):
            pass
        for task in list(self._tasks):
            task.cancel()

    def _spawn(self, coroutine) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)  # held: the loop keeps only a weak reference
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:  # never silently: a reload that broke
            log.error("reloading the credentials failed: %r", task.exception())
