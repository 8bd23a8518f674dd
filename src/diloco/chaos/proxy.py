"""A userspace TCP proxy that injects latency, jitter, bandwidth caps, dropped connections and partitions.

Each accepted connection gets its own connection to the target. Every direction is a reader and a writer
joined by a queue: the reader paces the bytes at the bandwidth cap (so the sender feels back-pressure, as
behind a slow link), and the writer holds each chunk until its propagation delay has passed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger("diloco.chaos")

READ_BYTES = 64 << 10
QUEUE_CHUNKS = 256  # chunks in flight per direction: at most 16 MiB buffered between reader and writer


@dataclass
class LinkFaults:
    """The faults a FaultProxy applies to every connection; replace them at any time with set_faults."""

    latency_ms: float = 0.0
    """One-way delay added to every chunk, in each direction."""
    jitter_ms: float = 0.0
    """Extra delay drawn uniformly from [0, jitter_ms] per chunk; never reorders bytes within a connection."""
    bandwidth_bps: float | None = None
    """Cap in bytes per second, per direction and per connection; None leaves the link uncapped."""
    drop_every_seconds: float | None = None
    """Abruptly close every open connection this often; None never drops."""

    def __post_init__(self):
        if not (self.latency_ms >= 0 and self.jitter_ms >= 0):
            raise ValueError(f"latency and jitter must be >= 0 ms, got {self.latency_ms} and {self.jitter_ms}")
        if not all(v is None or v > 0 for v in (self.bandwidth_bps, self.drop_every_seconds)):
            raise ValueError(f"bandwidth and drop period must be positive, got {self.bandwidth_bps} and "
                             f"{self.drop_every_seconds}")


@dataclass
class Lane:
    """Timing state of one direction of one connection."""

    sent_until: float = 0.0
    """When the bytes accepted so far have passed the bandwidth cap."""
    released: float = 0.0
    """When the previous chunk is released: a later chunk never overtakes it."""

    def plan(self, now: float, nbytes: int, faults: LinkFaults, rng: random.Random) -> tuple[float, float]:
        """(when this chunk has passed the cap, when it reaches the other side), as loop times in seconds."""
        sent = now
        if faults.bandwidth_bps:
            sent = self.sent_until = max(self.sent_until, now) + nbytes / faults.bandwidth_bps
        delay_ms = faults.latency_ms + (rng.uniform(0.0, faults.jitter_ms) if faults.jitter_ms else 0.0)
        self.released = max(self.released, sent + delay_ms / 1000)
        return sent, self.released


def split_address(text: str) -> tuple[str, int]:
    """("host", port) from "host:port" or "[v6]:port"; ValueError naming the text otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def _reset(writer: asyncio.StreamWriter | None) -> None:
    """Close with a TCP reset, not a FIN, so the peer sees a broken connection at once."""
    if writer is None or writer.transport.is_closing():
        return
    with contextlib.suppress(OSError):
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@dataclass(eq=False)
class _Link:
    """One client connection and its connection to the target."""

    client: asyncio.StreamWriter
    handler: asyncio.Task
    target: asyncio.StreamWriter | None = None
    tasks: list[asyncio.Task] = field(default_factory=list)
    dropped: bool = False

    def drop(self) -> None:
        self.dropped = True
        _reset(self.client)
        _reset(self.target)
        for task in self.tasks:
            task.cancel()


class FaultProxy:
    """Forwards every connection on (listen_host, listen_port) to (target_host, target_port) with faults."""

    def __init__(self, target_host: str, target_port: int, listen_host: str = "127.0.0.1", listen_port: int = 0,
                 faults: LinkFaults | None = None, seed: int = 0, connect_timeout: float = 10.0):
        self.target_host, self.target_port = target_host, target_port
        self.listen_host, self.port = listen_host, listen_port
        self.faults = faults or LinkFaults()
        self.connect_timeout = connect_timeout
        self.bytes_up = 0
        """Payload bytes forwarded from clients to the target."""
        self.bytes_down = 0
        """Payload bytes forwarded from the target to clients."""
        self.drops = 0
        """Connections closed by drop_connections, drop_every_seconds or a partition."""
        self._rng = random.Random(seed)
        self._links: set[_Link] = set()
        self._partition_until = 0.0
        self._server: asyncio.AbstractServer | None = None
        self._dropper: asyncio.Task | None = None
        self._faults_changed: asyncio.Event | None = None

    connections = property(lambda self: len(self._links), doc="Connections open now.")
    partitioned = property(lambda self: time.monotonic() < self._partition_until, doc="Whether a partition is on.")

    async def start(self) -> None:
        self._faults_changed = asyncio.Event()
        self._server = await asyncio.start_server(self._serve, self.listen_host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]  # the one picked when asked for port 0
        self._dropper = asyncio.create_task(self._drop_periodically())

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        self._dropper.cancel()
        links = list(self._links)
        for link in links:  # closed by the shutdown: not counted as drops
            link.drop()
        if links:  # let the handlers finish, rather than be cancelled mid-way when the loop shuts down
            await asyncio.wait([link.handler for link in links])
        await self._server.wait_closed()

    def set_faults(self, faults: LinkFaults) -> None:
        """Applies to every chunk read from now on; chunks already queued keep their release times."""
        restart_drops = faults.drop_every_seconds != self.faults.drop_every_seconds
        self.faults = faults
        if restart_drops and self._faults_changed is not None:
            self._faults_changed.set()

    def drop_connections(self) -> None:
        """Reset every open connection on both sides, as a crashed middlebox or a flapping link would."""
        self.drops += len(self._links)
        for link in list(self._links):
            link.drop()

    def partition(self, seconds: float) -> None:
        """Drop every connection now and reset new ones for `seconds`; connections are accepted again after."""
        self._partition_until = time.monotonic() + seconds
        self.drop_connections()

    async def _drop_periodically(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._faults_changed.wait(), self.faults.drop_every_seconds)
                self._faults_changed.clear()  # a new drop period starts now
            except asyncio.TimeoutError:
                log.info("dropping %d connection(s)", len(self._links))
                self.drop_connections()

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        link = _Link(client_writer, asyncio.current_task())
        self._links.add(link)
        clean = False
        try:
            if self.partitioned:
                self.drops += 1
                return
            # Tasks, awaited through asyncio.wait, so that a drop cancels them and this handler still ends normally.
            link.tasks = [asyncio.create_task(asyncio.wait_for(
                asyncio.open_connection(self.target_host, self.target_port), self.connect_timeout))]
            await asyncio.wait(link.tasks)
            try:
                target_reader, link.target = link.tasks[0].result()
            except (OSError, asyncio.TimeoutError, asyncio.CancelledError) as e:
                if not link.dropped:
                    log.warning("cannot reach %s:%d (%r); closing the client", self.target_host, self.target_port, e)
                return
            if link.dropped:
                return
            up, down = asyncio.Queue(QUEUE_CHUNKS), asyncio.Queue(QUEUE_CHUNKS)
            link.tasks = [asyncio.create_task(c) for c in (
                self._read(client_reader, up, Lane()), self._write(up, link.target, "bytes_up"),
                self._read(target_reader, down, Lane()), self._write(down, client_writer, "bytes_down"))]
            done, pending = await asyncio.wait(link.tasks, return_when=asyncio.FIRST_EXCEPTION)
            errors = [t.exception() for t in done if not t.cancelled()]  # a reset peer: expected, not logged
            clean = not pending and not link.dropped and not any(errors)
        finally:
            self._links.discard(link)
            if clean:  # both sides ended their streams: a normal close
                link.client.close()
                link.target.close()
            else:
                link.drop()

    async def _read(self, reader: asyncio.StreamReader, queue: asyncio.Queue, lane: Lane) -> None:
        loop = asyncio.get_running_loop()
        while data := await reader.read(READ_BYTES):
            sent, release = lane.plan(loop.time(), len(data), self.faults, self._rng)
            await asyncio.sleep(max(0.0, sent - loop.time()))  # back-pressure: read no faster than the cap
            await queue.put((release, data))
        await queue.put(None)

    async def _write(self, queue: asyncio.Queue, writer: asyncio.StreamWriter, counter: str) -> None:
        loop = asyncio.get_running_loop()
        while (item := await queue.get()) is not None:
            release, data = item
            await asyncio.sleep(max(0.0, release - loop.time()))
            setattr(self, counter, getattr(self, counter) + len(data))  # before the write: a reader may see it at once
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():  # pass a half-close on; the other direction may still be sending
            writer.write_eof()


class ProxyThread:
    """A FaultProxy on its own event loop in a background thread, for tests and synchronous code."""

    def __init__(self, target: str, listen: str = "127.0.0.1:0", faults: LinkFaults | None = None, seed: int = 0,
                 timeout: float = 10.0):
        target_host, target_port = split_address(target)
        listen_host, listen_port = split_address(listen)
        self.proxy = FaultProxy(target_host, target_port, listen_host, listen_port, faults, seed)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="fault-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout) or self._error:
            raise RuntimeError(f"proxy did not start on {listen}: {self._error}")

    def _main(self) -> None:
        async def main():
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            await self.proxy.start()
            self._ready.set()
            await self._stop.wait()
            await self.proxy.stop()

        try:
            asyncio.run(main())
        except BaseException as e:  # surfaced to the starting thread
            self._error = e
            self._ready.set()

    def _call(self, fn, *args):
        """Run fn on the proxy's loop and wait for it, so its effect is visible when this returns."""
        async def call():
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(call(), self._loop).result(10)

    @property
    def address(self) -> str:
        """Where clients connect: the listen host, or loopback when listening on every interface."""
        host = self.proxy.listen_host
        host = "127.0.0.1" if host in ("", "0.0.0.0", "::") else f"[{host}]" if ":" in host else host
        return f"{host}:{self.proxy.port}"

    bytes_up = property(lambda self: self.proxy.bytes_up, doc="Payload bytes forwarded from clients to the target.")
    bytes_down = property(lambda self: self.proxy.bytes_down, doc="Payload bytes forwarded from the target to clients.")
    connections = property(lambda self: self.proxy.connections, doc="Connections open now.")
    partitioned = property(lambda self: self.proxy.partitioned, doc="Whether a partition is in force now.")

    def set_faults(self, faults: LinkFaults) -> None:
        self._call(self.proxy.set_faults, faults)

    def drop_connections(self) -> None:
        self._call(self.proxy.drop_connections)

    def partition(self, seconds: float) -> None:
        self._call(self.proxy.partition, seconds)

    def stop(self, timeout: float = 10.0) -> None:
        """Close the listener and every connection; calling it again is harmless."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)
