"""How long joining a run takes with GPT-2 124M, and how many bytes it moves. The first learner uploads the
initial model (Init) and joins; a second learner built the same way (same seed) joins, and so does a third with
other weights, which downloads the global model. Then a syncer started from a checkpoint of the same weights
(`--initial-model`) takes a learner that loaded them: nobody uploads. Measured over loopback and through a proxy
capped at --bandwidth in each direction.

    python -m benchmarks.learner.join_time --bandwidth 50mbit --json runs/join-time.json

The model is transformers' GPT2LMHeadModel(GPT2Config()) (124M parameters, about 500 MB in fp32). Each link gets a
fresh syncer (decoupled defaults) in a process of its own; the learners and the proxy run in this process.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from diloco import GrpcTransport, Learner
from diloco.chaos import LinkFaults, ProxyThread
from diloco.chaos.proxy_command import parse_rate
from benchmarks.learner.overhead import SyncerProcess  # the syncer in its own process
from benchmarks.provenance import stamped

STALL_SECONDS = 120.0
"""Deadline of a transport that fails a call only when it stops making progress (stall_timeout)."""


def build_gpt2(seed: int = 0) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)  # learners of one seed build the same model
    return GPT2LMHeadModel(GPT2Config())


def fp32_bytes() -> int:
    """The model's size in fp32, from a build on the meta device (no memory, no initialisation)."""
    with torch.device("meta"):
        return 4 * sum(p.numel() for p in build_gpt2().parameters())


def transport_options(model_bytes: int, bandwidth: float | None) -> dict:
    """Deadlines that a full-model transfer at this bandwidth fits in with room to spare."""
    if "stall_timeout" in inspect.signature(GrpcTransport).parameters:  # fails a transfer only when it stops moving
        return {"stall_timeout": STALL_SECONDS}
    # a fixed deadline per call: four model transfers' time at this bandwidth, at least 10 minutes
    return {"rpc_timeout": max(600.0, 4 * model_bytes / bandwidth if bandwidth else 0.0)}


class TimedInit:
    """Wraps a transport's upload of the initial model: its seconds and the bytes the transport counted for it."""

    def __init__(self, transport: GrpcTransport):
        self.transport, self.upload = transport, transport._initialise
        self.seconds: float | None = None
        self.bytes = 0

    def __call__(self, *args, **kwargs):
        sent, started = self.transport.bytes_sent, time.perf_counter()
        try:
            return self.upload(*args, **kwargs)
        finally:
            self.seconds = time.perf_counter() - started
            self.bytes = self.transport.bytes_sent - sent


def join_once(address: str, learner_id: str, options: dict, seed: int = 0) -> dict:
    """Build the model, join (uploading it if the syncer has none yet), leave; the figures of that join."""
    model = build_gpt2(seed)
    model_bytes = 4 * sum(p.numel() for p in model.parameters())
    transport = GrpcTransport(address, **options)
    transport._initialise = init = TimedInit(transport)  # no public hook times the upload alone
    started = time.perf_counter()
    learner = Learner(model, transport, learner_id)
    total = time.perf_counter() - started
    learner.close()  # leave without pushing: only the join is measured
    # Join = everything but the upload: the requests, and the download of the global model.
    return dict(learner=learner_id, seed=seed, model_bytes=model_bytes,
                init_seconds=init.seconds, init_bytes=init.bytes,
                join_seconds=total - (init.seconds or 0.0),
                join_bytes=transport.bytes_sent + transport.bytes_received - init.bytes,
                total_seconds=total, bytes_sent=transport.bytes_sent, bytes_received=transport.bytes_received)


def measure_link(bandwidth: float | None, checkpoint: Path) -> list[dict]:
    """Learners joining a fresh syncer one after the other, directly or through a capped proxy: the first uploads,
    a second of the same seed and a third of another join; then a learner joins a syncer started from
    `checkpoint` (seed 0's weights)."""
    options = transport_options(fp32_bytes(), bandwidth)
    link = "loopback" if bandwidth is None else f"{8 * bandwidth / 1e6:g} Mbit/s"
    results = []
    for syncer_options, learners in (({}, [("first", 0), ("same-seed", 0), ("other-seed", 1)]),
                                     ({"initial_model": checkpoint}, [("from-checkpoint", 0)])):
        with SyncerProcess(learners=2, options=syncer_options) as syncer:
            proxy = ProxyThread(syncer.address, faults=LinkFaults(bandwidth_bps=bandwidth)) if bandwidth else None
            try:
                address = proxy.address if proxy else syncer.address
                # One after the other, each leaving before the next joins: only one 124M model in memory.
                results += [join_once(address, learner_id, options, seed) for learner_id, seed in learners]
            finally:
                if proxy:
                    proxy.stop()
    for result in results:
        result.update(link=link, bandwidth_bytes_per_second=bandwidth, transport_options=options)
    return results


def save_checkpoint(path: Path) -> Path:
    """Seed 0's weights as a safetensors file, as a user would put a pretrained checkpoint on the syncer's disk."""
    from safetensors.torch import save_file

    save_file({k: v.detach().clone().contiguous() for k, v in build_gpt2(0).state_dict().items()}, str(path))
    return path


def print_table(results: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    mb = 1e6
    table = Table(title=f"joining a run with GPT-2 124M ({results[0]['model_bytes'] / mb:,.0f} MB in fp32)")
    for column in ("link", "learner", "init s", "init MB", "join s", "join MB", "total s"):
        table.add_column(column, justify="right")
    for r in results:
        init = "-" if r["init_seconds"] is None else f"{r['init_seconds']:.1f}"
        table.add_row(r["link"], r["learner"], init, f"{r['init_bytes'] / mb:,.1f}", f"{r['join_seconds']:.1f}",
                      f"{r['join_bytes'] / mb:,.1f}", f"{r['total_seconds']:.1f}")
    Console().print(table)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bandwidth", default="50mbit", help="cap of the proxied link, e.g. 50mbit or 6.25MB")
    p.add_argument("--no-loopback", action="store_true", help="measure only the capped link")
    p.add_argument("--json", type=Path, help="write every figure here")
    args = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = save_checkpoint(Path(folder) / "gpt2.safetensors")
        for bandwidth in ([] if args.no_loopback else [None]) + [parse_rate(args.bandwidth)]:
            results += measure_link(bandwidth, checkpoint)
            print(f"measured {results[-1]['link']}", file=sys.stderr)
    print_table(results)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(stamped({"links": results}, args), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
