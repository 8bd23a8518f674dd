"""How far one transfer (a join, the initial upload, a push) got and when it last moved; a transfer in which
nothing moved for its stall timeout is cancelled, and its error says how far it got."""

from __future__ import annotations

import contextlib
import threading
import time

import grpc


def megabytes(done: int, total: int = 0) -> str:
    return f"{done / 1e6:.1f} of {total / 1e6:.1f} MB" if total else f"{done / 1e6:.1f} MB"


class Stalled(Exception):
    """A transfer in which nothing moved for its stall timeout; it was cancelled."""

    def __init__(self, progress: "Progress"):
        super().__init__(f"nothing moved for {progress.stall:.0f} s after {progress.describe()}")
        self.progress = progress


class Progress:
    """How far one transfer got and when it last moved, in whole gRPC messages (512 KiB chunks at most)."""

    def __init__(self, stall: float, total: int = 0):
        self.stall = stall
        self.total = total
        """Payload bytes the transfer carries, when known (for messages)."""
        self.done = 0
        self.last = time.monotonic()
        self.stalled = False

    def moved(self, nbytes: int) -> None:
        self.done += nbytes
        self.last = time.monotonic()

    def idle(self) -> float:
        return time.monotonic() - self.last

    def describe(self) -> str:
        return megabytes(self.done, self.total)

    @contextlib.contextmanager
    def watching(self, call):
        """Cancels `call` from a watchdog thread once nothing moved for `stall` seconds; the call's error then
        becomes Stalled."""
        finished = threading.Event()

        def watch() -> None:
            while not finished.wait(min(1.0, self.stall / 4)):
                if self.idle() > self.stall:
                    self.stalled = True
                    call.cancel()
                    return

        threading.Thread(target=watch, name="learner-stall-watchdog", daemon=True).start()
        try:
            yield
        except (grpc.RpcError, grpc.FutureCancelledError):
            if self.stalled:
                raise Stalled(self) from None
            raise
        finally:
            finished.set()


class Furthest:
    """The furthest that attempts of a transfer which starts over after a broken connection got (a join, the upload),
    and when one last got further: attempts that break again and again at the same point stall it as a whole."""

    def __init__(self, stall: float, clock=time.monotonic):
        self.stall, self.clock = stall, clock
        self.done = 0
        self.since = clock()
        self.breaks = 0

    def broke(self, attempt: Progress) -> bool:
        """Counts an attempt its connection ended; whether nothing got further than before for `stall` seconds."""
        self.breaks += 1
        if attempt.done > self.done:
            self.done, self.since = attempt.done, attempt.last
        return self.clock() - self.since > self.stall

    def describe(self, total: int, error: grpc.RpcError) -> str:
        """How far the attempts got, once they stalled, ending with the last attempt's error."""
        return (f"got no further than {megabytes(self.done, total)} in {self.stall:.0f} s; its connection broke "
                f"{self.breaks} times ({error.code().name}: {error.details()}) and it started over each time")
