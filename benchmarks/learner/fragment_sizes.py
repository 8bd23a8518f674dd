"""What the largest fragment costs the learner's training thread: `Learner.step`'s host time with whole tensors (the
published layout: a GPT's tied embedding and head, with the positions, in one fragment) and with `--split-tensors`.

    python -m benchmarks.learner.fragment_sizes --model 124m --json benchmarks/learner/results/fragment_sizes_124m.json

The models are this project's GPT at 35M and GPT-2 small's shape (124M), on the CPU with one torch thread. Nothing
is trained: each step multiplies matrices for `--step-ms` (a training step's compute, which releases the GIL as
torch's kernels do, so the learner's sender thread encodes meanwhile as it would), moves every parameter a little in
place (a fixed random direction per parameter, scaled by the step, so that no push repeats an earlier one), then
calls `Learner.step`, whose time is measured. The learner joins a fresh syncer (decoupled defaults:
P = 24, H = 24, int4 up) in a process of its own at the lowest CPU priority. One cycle of the fragments is untimed
(the staging ring fills); the next `--cycles` are timed. Whole and split runs alternate, `--repeats` of each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.learner.overhead import SyncerProcess, join_deadlines
from benchmarks.learner.walk import MODELS
from benchmarks.provenance import stamped
from diloco.train.train_config import ModelConfig

H = 24


def compute(ms: float, a: torch.Tensor) -> None:
    deadline = time.perf_counter() + ms / 1e3
    while time.perf_counter() < deadline:
        torch.mm(a, a)


SMOKE = ModelConfig(vocab_size=512, seq_len=64, d_model=64, n_layers=2, n_heads=2)


def run(name: str, split: bool, cycles: int, step_ms: float) -> dict:
    from diloco import GrpcTransport, Learner
    from diloco.train.model import build_model

    torch.set_num_threads(1)
    model = build_model(SMOKE if name == "smoke" else MODELS[name], 0)
    parameters = [p for p in model.parameters()]
    generator = torch.Generator().manual_seed(0)
    directions = [torch.randn(p.shape, generator=generator) for p in parameters]
    with SyncerProcess(split_tensors=split) as syncer:
        learner = Learner(model, GrpcTransport(syncer.address, **join_deadlines(GrpcTransport)), "bench")
        total = sum(f.numel for f in learner.layout if f.role == "params")
        largest = max(f.numel for f in learner.layout if f.role == "params")
        times = []
        a = torch.randn(256, 256, generator=generator)
        for step in range((1 + cycles) * H):
            compute(step_ms, a)
            with torch.no_grad():
                for p, d in zip(parameters, directions):
                    p.add_(d, alpha=1e-5 * (1 + step % 5))
            started = time.perf_counter()
            learner.step(tokens=8192)
            if step >= H:
                times.append(time.perf_counter() - started)
        learner.finish()
    ms = sorted(1e3 * t for t in times)
    return dict(model=name, split_tensors=split, step_ms=step_ms, parameters=total, largest_fragment_share=largest / total,
                steps=len(ms), host_ms_median=statistics.median(ms), host_ms_p90=ms[int(0.9 * (len(ms) - 1))],
                host_ms_max=ms[-1], pushes=learner.pushes, applied=learner.applied, skipped=learner.skipped)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=[*sorted(MODELS), "smoke"], default="124m", help="smoke: a tiny GPT, for tests")
    p.add_argument("--cycles", type=int, default=2, help="timed cycles of the fragments (H steps each)")
    p.add_argument("--step-ms", type=float, default=200.0, help="compute per step before Learner.step, in ms")
    p.add_argument("--repeats", type=int, default=2, help="runs of each layout, alternating")
    p.add_argument("--json", type=Path, help="write every run and the medians here")
    args = p.parse_args()
    runs = []
    for repeat in range(args.repeats):
        for split in (False, True):
            r = run(args.model, split, args.cycles, args.step_ms)
            print(f"repeat {repeat + 1}/{args.repeats} {'split' if split else 'whole'}: largest fragment "
                  f"{100 * r['largest_fragment_share']:.1f}% of the model; Learner.step median {r['host_ms_median']:.2f} "
                  f"ms, p90 {r['host_ms_p90']:.2f} ms, max {r['host_ms_max']:.2f} ms", file=sys.stderr)
            runs.append(r)
    summary = {}
    for split in (False, True):
        mine = [r for r in runs if r["split_tensors"] == split]
        summary["split" if split else "whole"] = {k: statistics.median(r[k] for r in mine) for k in
                                                  ("largest_fragment_share", "host_ms_median", "host_ms_p90",
                                                   "host_ms_max")}
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(stamped(dict(model=args.model, summary=summary, runs=runs), args), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
