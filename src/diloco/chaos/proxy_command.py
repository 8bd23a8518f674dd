"""`diloco proxy`: forward TCP (learners → syncer) with latency, jitter, a bandwidth cap, drops and partitions."""

from __future__ import annotations

import argparse
import asyncio
import math
import re
import signal
import time

from diloco.chaos.proxy import FaultProxy, LinkFaults, split_address

STATUS_SECONDS = 10.0
_RATE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([kmg]?)(bit|b?)", re.IGNORECASE)
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9}


def parse_rate(text: str) -> float:
    """Bytes per second from "10mbit", "500kbit", "1gbit" (bits per second) or "2MB", "64kb", "1000" (bytes).

    Units follow tc: a "bit" suffix counts bits, anything else bytes; prefixes are decimal. "Mbps" is refused
    because tools disagree on whether it means bits or bytes.
    """
    match = _RATE.fullmatch(text.strip())
    value = float(match[1]) * _PREFIX[match[2].lower()] if match else math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"bad rate {text!r}: expected a positive number with a unit such as 10mbit, 500kbit or "
                         f"1gbit (bits per second), or 2MB, 64kb or 1000 (bytes per second)")
    return value / 8 if match[3].lower() == "bit" else value


def _address(text: str) -> str:
    try:
        split_address(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("proxy", help="forward TCP with injected network faults (tests, rehearsals)",
                       description="Forward TCP connections, e.g. from learners to the syncer, adding latency, "
                                   "jitter, a bandwidth cap, dropped connections and a partition.")
    p.add_argument("--listen", type=_address, required=True, help="HOST:PORT to accept connections on (port 0: any)")
    p.add_argument("--target", type=_address, required=True, help="HOST:PORT to forward to, e.g. the syncer")
    p.add_argument("--latency-ms", type=float, default=0.0, help="one-way delay added in each direction (0)")
    p.add_argument("--jitter-ms", type=float, default=0.0, help="extra delay up to this, uniform; never reorders (0)")
    p.add_argument("--bandwidth", metavar="RATE", help="cap per direction and connection: 10mbit, 1gbit, 2MB (bytes/s)")
    p.add_argument("--drop-every", type=float, metavar="SECONDS", help="reset every open connection this often")
    p.add_argument("--partition-at", type=float, metavar="SECONDS", help="seconds after start when a partition begins")
    p.add_argument("--partition-for", type=float, metavar="SECONDS", help="how long the partition lasts")
    p.add_argument("--seed", type=int, default=0, help="seed of the jitter (0)")
    p.set_defaults(func=cmd_proxy)


def faults_from_args(args) -> LinkFaults:
    bandwidth = parse_rate(args.bandwidth) if args.bandwidth else None
    return LinkFaults(args.latency_ms, args.jitter_ms, bandwidth, args.drop_every)


def cmd_proxy(args) -> int:
    faults = faults_from_args(args)
    if (args.partition_at is None) != (args.partition_for is None):
        raise ValueError("--partition-at and --partition-for go together")
    if args.partition_at is not None and not (args.partition_at >= 0 and args.partition_for > 0):
        raise ValueError("--partition-at must be >= 0 and --partition-for > 0")
    return asyncio.run(_run(args, faults))


def describe(faults: LinkFaults) -> str:
    parts = [f"latency {faults.latency_ms:g} ms"] if faults.latency_ms else []
    parts += [f"jitter 0-{faults.jitter_ms:g} ms"] if faults.jitter_ms else []
    parts += [f"bandwidth {faults.bandwidth_bps:,.0f} B/s"] if faults.bandwidth_bps else []
    parts += [f"drop every {faults.drop_every_seconds:g} s"] if faults.drop_every_seconds else []
    return ", ".join(parts) or "no faults"


def status_line(proxy: FaultProxy, seconds: float) -> str:
    return (f"{seconds:7.0f}s  up {proxy.bytes_up:,} B  down {proxy.bytes_down:,} B  open {proxy.connections}  "
            f"dropped {proxy.drops}  {'PARTITIONED' if proxy.partitioned else 'connected'}")


async def _run(args, faults: LinkFaults) -> int:
    (listen_host, listen_port), (target_host, target_port) = split_address(args.listen), split_address(args.target)
    proxy = FaultProxy(target_host, target_port, listen_host, listen_port, faults, args.seed)
    await proxy.start()
    loop, stop, started = asyncio.get_running_loop(), asyncio.Event(), time.monotonic()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if args.partition_at is not None:
        def partition():
            proxy.partition(args.partition_for)
            print(f"partition: refusing connections for {args.partition_for:g} s", flush=True)

        loop.call_later(args.partition_at, partition)
    print(f"proxy listening on {listen_host}:{proxy.port}, forwarding to {args.target}; {describe(faults)}", flush=True)
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), STATUS_SECONDS)
        except asyncio.TimeoutError:
            print(status_line(proxy, time.monotonic() - started), flush=True)
    await proxy.stop()
    print(f"proxy stopped after {time.monotonic() - started:.0f} s: forwarded {proxy.bytes_up:,} B up and "
          f"{proxy.bytes_down:,} B down; {proxy.drops} connections dropped", flush=True)
    return 0
