"""Shaped network links for a local run (`diloco run --link RATE`): every learner or data-parallel worker in its own
network namespace, behind a veth pair rate-limited in both directions with `tc tbf`.

    root namespace                                  namespace diloco-<pid>-<k>-<i> (worker i)
    bridge dlbr<pid>-<k>, 10.A.B.1/24  ── port dl<pid>-<k>-<i> ══ veth ══ wan, 10.A.B.(i+2)/24
                                          tbf: host → worker          tbf: worker → host

The syncer (or its proxies) stays in the root namespace and is reached at 10.A.B.1. Worker-to-worker traffic (dp's
gloo) is bridged between the ports, so it crosses both workers' shaped links, as through a WAN hub; no IP
forwarding and no global sysctl is touched. A namespace has no default route: only the run's /24 is reachable, so
anything else (the DNS server gloo asks for a peer's name) fails at once instead of timing out. Deleting a
namespace deletes its veth pair; the bridge is deleted last. Names carry the owner's pid (hex in interface names,
which the kernel caps at 15 characters), so a later run removes what a crashed one left behind.
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import os
import re
import shutil
import signal
import subprocess
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("diloco.run")

INSIDE_IF = "wan"
"""The veth end inside every namespace; the same name in each, so GLOO_SOCKET_IFNAME is one value."""
IFNAMSIZ = 15
"""Longest interface name the kernel takes."""
MAX_WORKERS = 253
"""Addresses .2 to .254 of the run's /24."""
MIN_RATE = 8e3
NAMESPACE = re.compile(r"diloco-(\d+)-(\d+)-(\d+)")
BRIDGE = re.compile(r"dlbr([0-9a-f]+)-(\d+)")
SUBNETS = ipaddress.ip_network("10.128.0.0/9")
"""Where a run's /24 is picked from (one not routed here already)."""

_runs = itertools.count()
_live: set[tuple[int, int]] = set()  # (pid, k) of this process's links that are set up now


class LinkError(RuntimeError):
    """Shaped links cannot be set up here; the message says why and what to do."""


def parse_link(text: str) -> float | None:
    """Bits per second from `--link` ("5mbit", "500kbit", "1gbit"; "2MB" counts bytes, as in tc and `diloco
    proxy --bandwidth`), or None for "none" / "off". A unit is required."""
    from diloco.chaos.proxy_command import parse_rate

    if text.strip().lower() in ("none", "off"):
        return None
    try:
        if not text.strip()[-1:].isalpha():
            raise ValueError("a bare number: 5 would be 5 bytes per second, most likely not what was meant")
        bps = 8 * parse_rate(text)
    except ValueError:
        raise ValueError(f"bad --link {text!r}: expected a rate such as 5mbit, 100mbit, 500kbit or 1gbit (bits per "
                         f"second; 2MB means bytes per second), or none / off for unshaped links") from None
    if bps < MIN_RATE:
        raise ValueError(f"--link {text} is below 8kbit: nothing but keepalives would get through")
    return bps


def rate_text(bps: float) -> str:
    """The shortest exact tc spelling: 5000000 → "5mbit", 1500000 → "1500kbit"."""
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= scale and (bps / scale).is_integer():
            return f"{bps / scale:.0f}{unit}"
    return f"{bps:.0f}bit"


def check_can_shape() -> None:
    """Refuse early, before any run folder is written, where links cannot be made: not root, or no iproute2."""
    if os.geteuid() != 0:
        raise LinkError("--link needs root (network namespaces and tc): run as root, or drop --link")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise LinkError(f"--link needs iproute2's `ip` and `tc` on PATH; missing {', '.join(missing)} (Debian and "
                        f"Ubuntu: apt-get install iproute2), or drop --link")
    lacking = [name for name, bit in CAPABILITIES.items() if not _effective_capabilities() >> bit & 1]
    if lacking:
        raise LinkError(f"--link needs {' and '.join(lacking)}, which this root process lacks (in a container: "
                        f"--cap-add NET_ADMIN --cap-add SYS_ADMIN, or --privileged), or drop --link")


CAPABILITIES = {"CAP_NET_ADMIN": 12, "CAP_SYS_ADMIN": 21}
"""What `ip netns` and `tc` need: network administration, and mounts (a namespace is kept as a mount under
/run/netns)."""


def _effective_capabilities() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    except (OSError, ValueError):
        pass
    return -1  # unknown: let the commands say


@dataclass(frozen=True)
class Link:
    """Worker i's end of the run's network."""

    namespace: str
    host_if: str
    """The veth end in the root namespace (a port of the bridge): its tx bytes went to the worker, rx from it."""
    address: str
    """The worker's address inside its namespace."""


@dataclass(frozen=True)
class Layout:
    """Names and addresses of one run's links; `setup_commands` and `teardown_commands` are what it takes."""

    pid: int
    k: int
    subnet: ipaddress.IPv4Network
    workers: int
    rate_bps: float

    def __post_init__(self):
        if not 1 <= self.workers <= MAX_WORKERS:
            raise ValueError(f"--link takes 1 to {MAX_WORKERS} workers, got {self.workers}")
        too_long = [name for name in [self.bridge] + [x.host_if for x in self.links] if len(name) > IFNAMSIZ]
        if too_long:
            raise ValueError(f"interface name {too_long[0]} is longer than {IFNAMSIZ} characters")

    @property
    def bridge(self) -> str:
        return f"dlbr{self.pid:x}-{self.k}"

    @property
    def host_address(self) -> str:
        """The root namespace's address on the bridge: where workers reach the syncer."""
        return str(self.subnet.network_address + 1)

    @property
    def links(self) -> list[Link]:
        base = self.subnet.network_address
        return [Link(f"diloco-{self.pid}-{self.k}-{i}", f"dl{self.pid:x}-{self.k}-{i}", str(base + i + 2))
                for i in range(self.workers)]

    def tbf(self) -> list[str]:
        """Token bucket: a burst of 10 ms at the rate (at least 16 KiB, so a full frame always passes) and up to
        100 ms queued before tail drops."""
        burst = max(int(self.rate_bps / 8 / 100), 16 << 10)
        return ["root", "tbf", "rate", f"{self.rate_bps:.0f}bit", "burst", str(burst), "latency", "100ms"]

    def setup_commands(self) -> list[list[str]]:
        prefix = self.subnet.prefixlen
        cmds = [["ip", "link", "add", self.bridge, "type", "bridge"],
                ["ip", "link", "set", self.bridge, "addrgenmode", "none"],  # no IPv6 chatter in the counters
                ["ip", "addr", "add", f"{self.host_address}/{prefix}", "dev", self.bridge],
                ["ip", "link", "set", self.bridge, "up"]]
        for x in self.links:
            ns = ["-n", x.namespace]
            cmds += [["ip", "netns", "add", x.namespace],
                     ["ip", "link", "add", x.host_if, "type", "veth", "peer", "name", INSIDE_IF, "netns", x.namespace],
                     ["ip", "link", "set", x.host_if, "addrgenmode", "none"],
                     ["ip", *ns, "link", "set", INSIDE_IF, "addrgenmode", "none"],
                     ["ip", "link", "set", x.host_if, "master", self.bridge, "up"],
                     ["ip", *ns, "link", "set", "lo", "up"],
                     ["ip", *ns, "addr", "add", f"{x.address}/{prefix}", "dev", INSIDE_IF],
                     ["ip", *ns, "link", "set", INSIDE_IF, "up"],
                     ["tc", "qdisc", "add", "dev", x.host_if, *self.tbf()],
                     ["tc", *ns, "qdisc", "add", "dev", INSIDE_IF, *self.tbf()]]
        return cmds

    def teardown_commands(self) -> list[list[str]]:
        return [["ip", "netns", "delete", x.namespace] for x in self.links] + [["ip", "link", "delete", self.bridge]]


def _ip(*args: str, check: bool = True) -> str:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        hint = ""
        if "Operation not permitted" in proc.stderr or "Permission denied" in proc.stderr:
            hint = ("; network namespaces need CAP_NET_ADMIN (in a container: --cap-add NET_ADMIN, or --privileged)")
        raise LinkError(f"--link: `{' '.join(args)}` failed (exit {proc.returncode}): {proc.stderr.strip()}{hint}")
    return proc.stdout


def namespaces() -> list[str]:
    """Every named network namespace here (`ip netns list`)."""
    return [line.split()[0] for line in _ip("ip", "netns", "list").splitlines() if line.strip()]


def bridges() -> list[str]:
    out = _ip("ip", "-o", "link", "show", "type", "bridge")
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if line.count(":") >= 2]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stale(pid: int, k: int) -> bool:
    """Left by a run that is gone: its process has exited (or this process reuses its pid and never made it)."""
    return (pid, k) not in _live if pid == os.getpid() else not _alive(pid)


def _kill_inside(namespace: str) -> int:
    """SIGKILL whatever still runs in one of our namespaces (a worker that outlived its run), so it really goes."""
    pids = [int(p) for p in _ip("ip", "netns", "pids", namespace, check=False).split()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(pids)


def remove_stale() -> list[str]:
    """Delete the namespaces and bridges of runs whose process is gone; returns their names."""
    removed = []
    for name in namespaces():
        m = NAMESPACE.fullmatch(name)
        if m and _stale(int(m[1]), int(m[2])):
            left = _kill_inside(name)
            _ip("ip", "netns", "delete", name, check=False)
            removed.append(name + (f" ({left} processes killed)" if left else ""))
    for name in bridges():
        m = BRIDGE.fullmatch(name)
        if m and _stale(int(m[1], 16), int(m[2])):
            _ip("ip", "link", "delete", name, check=False)
            removed.append(name)
    if removed:
        log.warning("removed links left by an earlier run: %s", ", ".join(removed))
    return removed


def free_subnet(seed: int) -> ipaddress.IPv4Network:
    """A /24 of 10.128.0.0/9 that overlaps no route or address here, searched from a point that `seed` picks."""
    used = []
    for line in _ip("ip", "-o", "-4", "route", "show", "table", "all").splitlines() + \
            _ip("ip", "-o", "-4", "addr", "show").splitlines():
        for word in line.split():
            try:
                used.append(ipaddress.ip_network(word, strict=False))
            except ValueError:
                continue
    used = [u for u in used if u.prefixlen > 0]  # a default route overlaps everything
    candidates = list(SUBNETS.subnets(new_prefix=24))
    start = seed % len(candidates)
    for net in candidates[start:] + candidates[:start]:
        if not any(net.overlaps(u) for u in used):
            return net
    raise LinkError("--link: every /24 of 10.128.0.0/9 is in use here")


class ShapedLinks:
    """A context manager: `workers` namespaces, each behind a link of `rate_bps` bits per second each way.

    Exiting it, normally, by an exception, Ctrl-C or SIGTERM (turned into SystemExit while it is open, when it is
    entered on the main thread), kills what still runs in the namespaces and deletes them and the bridge.
    """

    def __init__(self, workers: int, rate_bps: float):
        self.layout = Layout(os.getpid(), next(_runs), ipaddress.ip_network("10.128.0.0/24"), workers, rate_bps)
        self.bytes: dict[int, dict[str, int]] | None = None
        """Per worker, {"up": bytes from it, "down": bytes to it} as its host end counted them when the links came
        down (frames with their Ethernet headers, ARP included)."""
        self._signals: dict[int, object] = {}

    links = property(lambda self: self.layout.links)
    host_address = property(lambda self: self.layout.host_address, doc="Where workers reach the root namespace.")

    def wrap(self, i: int, cmd: list[str]) -> list[str]:
        """`cmd` run inside worker i's namespace (`ip netns exec` execs it: same pid, signals reach it)."""
        return ["ip", "netns", "exec", self.links[i].namespace, *cmd]

    def __enter__(self) -> ShapedLinks:
        check_can_shape()
        remove_stale()
        layout = self.layout
        seed = zlib.crc32(f"{layout.pid}-{layout.k}".encode())
        self.layout = Layout(layout.pid, layout.k, free_subnet(seed), layout.workers, layout.rate_bps)
        _live.add((layout.pid, layout.k))
        self._catch_signals()
        try:
            for cmd in self.layout.setup_commands():
                _ip(*cmd)
        except BaseException:
            self._teardown()
            raise
        log.info("%d shaped links at %s each way on %s", layout.workers, rate_text(layout.rate_bps), self.layout.subnet)
        return self

    def __exit__(self, *exc) -> None:
        self._teardown()

    def counters(self) -> dict[int, dict[str, int]]:
        """Bytes each worker's link has carried so far: up (worker → host end) and down."""
        def read(x: Link, what: str) -> int:
            try:
                return int(Path(f"/sys/class/net/{x.host_if}/statistics/{what}_bytes").read_text())
            except (OSError, ValueError):
                return 0

        return {i: {"up": read(x, "rx"), "down": read(x, "tx")} for i, x in enumerate(self.links)}

    def _teardown(self) -> None:
        if (self.layout.pid, self.layout.k) not in _live:
            return
        previous = signal.getsignal(signal.SIGINT) if self._on_main_thread() else None
        if previous is not None:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not leave half the links behind
        try:
            self.bytes = self.counters()
            try:
                present = set(namespaces())
            except LinkError:
                present = {x.namespace for x in self.links}
            left = sum(_kill_inside(x.namespace) for x in self.links if x.namespace in present)
            if left:
                log.warning("%d processes still ran inside the run's namespaces: killed", left)
            failed = []
            for cmd in self.layout.teardown_commands():
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
                if proc.returncode != 0 and "No such file" not in proc.stderr and "Cannot find" not in proc.stderr:
                    failed.append(f"`{' '.join(cmd)}`: {proc.stderr.strip()}")
            if failed:
                log.error("could not remove every link; run by hand: %s", "; ".join(failed))
        finally:
            _live.discard((self.layout.pid, self.layout.k))
            self._restore_signals()
            if previous is not None:
                signal.signal(signal.SIGINT, previous)

    @staticmethod
    def _on_main_thread() -> bool:
        return threading.current_thread() is threading.main_thread()

    def _catch_signals(self) -> None:
        """SIGTERM and SIGHUP end a process without running `finally` blocks: make them raise SystemExit instead,
        while the links exist, where nobody else handles them."""
        if not self._on_main_thread():
            return

        def leave(signum, frame):
            raise SystemExit(128 + signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is signal.SIG_DFL:
                self._signals[sig] = signal.signal(sig, leave)

    def _restore_signals(self) -> None:
        for sig, handler in self._signals.items():
            signal.signal(sig, handler)
        self._signals.clear()


def link_text(plan) -> str | None:
    """The links as the report and the display name them: "5mbit each way, +40 ms", or None on loopback."""
    link, latency = getattr(plan, "link", None), getattr(plan, "link_latency_ms", 0.0)
    parts = [f"{rate_text(link)} each way"] if link else []
    parts += [f"+{latency:g} ms to the syncer"] if latency else []
    return ", ".join(parts) or None
