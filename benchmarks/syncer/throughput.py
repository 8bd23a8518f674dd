"""How fast the syncer merges contributions and makes a round durable, against this machine's own limits.

- merge: GB/s of fp32 contributions folded into a round's running sums (StreamingMerge: RDA with the mean
  fallback, RDA with one running sum, mean), and of
  whole pushes through SyncerCore (int4 decoding, validation and folding), against memcpy GB/s measured in the
  same run (a tensor copy of the same size);
- durability: seconds to write one round's state (Θ, momentum and the pending Δ of one fragment, fsynced, plus
  the ledger and manifest) for a model of --params parameters in --fragments fragments, against the disk's
  sequential write rate measured in the same folder.

    python -m benchmarks.syncer.throughput --numel 16000000 --params 1e9 --fragments 24 --json runs/throughput.json

Figures are medians of --repeats runs; the machine is shared, so compare ratios from one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from diloco.algorithm import codec
from diloco.config import SyncConfig
from diloco.algorithm.fragments import TensorSpec
from diloco.algorithm.merge import StreamingMerge
from diloco.syncer.buffers import Buffers
from diloco.syncer.core import REUSED_FRAGMENTS, FragmentState, SyncerCore
from diloco.syncer.at_rest.store import StateStore
from benchmarks.provenance import stamped


def median_seconds(fn, repeats: int, setup=None) -> float:
    """Median wall time of `fn(setup())` (or `fn()`); `setup` runs outside the timing."""
    times = []
    for _ in range(repeats):
        arg = setup() if setup else None
        started = time.perf_counter()
        fn(arg) if setup else fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def merge_figures(numel: int, learners: int, repeats: int) -> dict:
    torch.manual_seed(0)
    deltas = [torch.randn(numel) * 1e-3 for _ in range(learners)]
    target = torch.empty(numel)
    gb = numel * 4 / 1e9
    out = {"numel": numel, "learners": learners, "memcpy_gb_per_s": gb / median_seconds(lambda: target.copy_(deltas[0]), repeats)}
    segments = [(numel // 2, False), (numel - numel // 2, False)]
    buffers = Buffers(REUSED_FRAGMENTS * numel * 4)  # as the core: RDA's second sum is reused round after round
    # rda: the paper's, with the mean fallback (two running sums); rda_one_sum: --no-rda-mean-fallback
    for name, method, fallback in (("rda", "rda", True), ("rda_one_sum", "rda", False), ("mean", "mean", True)):
        def fold(first, method=method, fallback=fallback):
            merge = StreamingMerge(segments, method, buffers, fallback)
            merge.add(first, 1.0)  # taken over as the running sum, as a decoded push is
            for d in deltas[1:]:
                merge.add(d, 1.0)
            merge.result()
        out[f"merge_{name}_gb_per_s"] = gb * learners / median_seconds(fold, repeats, setup=lambda: deltas[0].clone())
    # whole pushes: decode int4, validate, fold (what a push costs the core worker)
    specs = [TensorSpec("w", (numel,), "float32")]
    core = SyncerCore(SyncConfig(fragments=1, codec="int4", down_codec="int8", grace=0.0, quorum=learners))
    core.initialize(specs, [torch.randn(numel)])
    sessions = [core.join(f"l{i}", specs) for i in range(learners)]
    payloads = [codec.encode(d, "int4") for d in deltas]
    seq = [0]

    def pushes():
        seq[0] += 1
        for i, (session, payload) in enumerate(zip(sessions, payloads)):
            assert core.push(f"l{i}", session, seq[0], 0, core.fragments[0].version, 24, 24 * 1024, payload).accepted
        core.poll(force=True)
    out["push_int4_gb_per_s"] = gb * learners / median_seconds(pushes, repeats)  # fp32 GB of contributions merged
    for key in ("merge_rda_gb_per_s", "merge_rda_one_sum_gb_per_s", "merge_mean_gb_per_s", "push_int4_gb_per_s"):
        out[key.replace("_gb_per_s", "_vs_memcpy")] = out[key] / out["memcpy_gb_per_s"]
    return out


def durability_figures(params: float, fragments: int, folder: Path, repeats: int, outer_momentum: float) -> dict:
    """One round's durable write; with μ = 0 (decoupled mode) only Θ is written, else Θ, momentum and pending Δ."""
    numel = int(params // fragments)
    theta, momentum = torch.randn(numel), torch.zeros(numel)
    spec = [TensorSpec("w", (numel,), "float32")]
    core = SyncerCore(SyncConfig(fragments=1, outer_momentum=outer_momentum), store=StateStore(folder))
    core.initialize(spec, [theta])  # writes generation 1
    fs: FragmentState = core.fragments[0]
    fs.momentum = momentum

    def round_write():
        fs.version += 1
        core.persist([0])
    seconds = median_seconds(round_write, repeats)
    # the disk's sequential rate in the same folder, fsynced, for the same bytes
    raw = theta.numpy().tobytes()
    path = folder / "raw.bin"
    tensors = 3 if outer_momentum else 1

    def raw_write():
        with open(path, "wb") as f:
            for _ in range(tensors):  # Θ (and momentum, pending Δ)
                f.write(raw)
            f.flush()
            os.fsync(f.fileno())
    raw_seconds = median_seconds(raw_write, repeats)
    path.unlink()
    written = tensors * numel * 4
    return {"params": params, "fragments": fragments, "outer_momentum": outer_momentum, "fragment_numel": numel,
            "bytes_per_round": written,
            "round_write_seconds": seconds, "disk_write_seconds": raw_seconds,
            "round_write_gb_per_s": written / seconds / 1e9, "disk_gb_per_s": written / raw_seconds / 1e9,
            "rounds_per_second": 1 / seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=16_000_000, help="values per merged fragment (64 MB in fp32)")
    p.add_argument("--learners", type=int, default=4)
    p.add_argument("--params", type=float, default=1e9, help="model size for the durability figures")
    p.add_argument("--fragments", "-P", type=int, default=24)
    p.add_argument("--state", type=Path, help="folder for the durability figures (default: a temporary one)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    torch.set_num_threads(1)  # the core worker is one thread
    merge = merge_figures(args.numel, args.learners, args.repeats)
    print(json.dumps(merge, indent=1))
    durability = []
    for mu in (0.0, 0.9):  # decoupled mode's μ, and DiLoCo's
        with tempfile.TemporaryDirectory(dir=args.state) as folder:
            durability.append(durability_figures(args.params, args.fragments, Path(folder), max(3, args.repeats // 2), mu))
        print(json.dumps(durability[-1], indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(stamped({"merge": merge, "durability": durability}, args), indent=1))


if __name__ == "__main__":
    main()
