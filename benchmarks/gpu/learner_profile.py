"""Where `Learner.step` spends the training thread's time on a GPU: host seconds per call of the training step and of
`Learner.step`, the wall time per step, and every blocking wait for the device by thread (gpu_overhead.count_waits).

    python -m benchmarks.gpu.learner_profile --device cuda --out runs/learner_profile    # about a minute
    python -m benchmarks.gpu.learner_profile --device cpu --smoke                         # the same code, seconds

Writes OUT/learner_profile.json and prints a summary; scale.py's overhead part gives the tokens/s ratio this
explains.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


from benchmarks.gpu.overhead import count_waits
from benchmarks.gpu.setup import Replica, Setup, model_configs, sync
from benchmarks.learner.overhead import SyncerProcess, join_deadlines

from diloco import GrpcTransport, Learner
from diloco.train.train_config import TrainConfig
from benchmarks.provenance import stamped


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--smoke", action="store_true", help="a tiny model, a few steps")
    p.add_argument("--model", default="35m", choices=("35m", "124m"))
    p.add_argument("--batch", type=int, default=16, help="sequences per step (16)")
    p.add_argument("--steps", type=int, default=40, help="steps per measured phase (40)")
    p.add_argument("--split-tensors", action="store_true", help="the run's layout cuts tensors larger than a P-th of "
                   "the model (the tied embedding and head) into pieces in several fragments")
    p.add_argument("--device-codec", action="store_true", help="Learner(device_codec=True): each push's Δ computed "
                   "and encoded on the device, only the payload copied to the host")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (the Learner joins it compiled)")
    p.add_argument("--out", type=Path, default=Path("runs/learner_profile"))
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cfg = model_configs(32768, args.smoke)[args.model]
    steps, batch = (4, 2) if args.smoke else (args.steps, args.batch)
    setup = Setup(device, cfg, TrainConfig(model=cfg, batch_size=batch), batch)
    rep = Replica(setup)
    if args.compile:
        rep.model = torch.compile(rep.model)
    gen = torch.Generator(device=device).manual_seed(0)

    def phase(learner) -> dict:
        step_host, learner_host = [], []
        sync(device)
        started = time.perf_counter()
        for _ in range(steps):
            rows = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), device=device, generator=gen)
            t0 = time.perf_counter()
            rep.step(rows[:, :-1], rows[:, 1:], 1e-3)
            t1 = time.perf_counter()
            if learner is not None:
                learner.step(batch * cfg.seq_len)
            step_host.append(t1 - t0)
            learner_host.append(time.perf_counter() - t1)
        sync(device)
        wall = time.perf_counter() - started
        return dict(wall_per_step=wall / steps, step_host_median=statistics.median(step_host),
                    learner_host_median=statistics.median(learner_host), learner_host_max=max(learner_host),
                    learner_host_mean=statistics.fmean(learner_host))

    result: dict = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                        torch=torch.__version__, model=args.model, batch=[batch, cfg.seq_len], steps=steps,
                        split_tensors=args.split_tensors, device_codec=args.device_codec, compiled=args.compile)
    with SyncerProcess(learners=1, split_tensors=args.split_tensors) as syncer:
        learner = Learner(rep.model, GrpcTransport(syncer.address, **join_deadlines(GrpcTransport)), "profile",
                          device_codec=args.device_codec)
        try:
            phase(None), phase(learner)  # warm-up
            result["plain"] = phase(None)
            result["learner"] = phase(learner)
            result["waits"] = count_waits(lambda: phase(learner), device)
            learner.finish(timeout=120)
        except BaseException:
            learner.close()
            raise
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "learner_profile.json").write_text(json.dumps(stamped(result, args), indent=1, default=str))
    for name in ("plain", "learner"):
        r = result[name]
        print(f"{name:8s} wall/step {r['wall_per_step'] * 1e3:7.2f} ms; host: step {r['step_host_median'] * 1e3:6.2f} ms,"
              f" Learner.step median {r['learner_host_median'] * 1e3:6.2f} ms (mean {r['learner_host_mean'] * 1e3:.2f},"
              f" max {r['learner_host_max'] * 1e3:.2f})")
    print("waits for the device with the Learner, by thread:", json.dumps(result["waits"]["threads"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
