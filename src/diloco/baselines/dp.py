"""Synchronous data-parallel training, the baseline: gradients all-reduced (gloo) every step (DESIGN §3.5, §7).

Same model, data shards, optimizer and budgets as the learners; one process per worker, launched by `diloco run
--mode dp`. Wire bytes are counted as a ring all-reduce moves them: 2·(M−1)/M × gradient bytes per worker per step.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from diloco.train.config import lr_at, make_inner_optimizer
from diloco.train.data import Corpus, ShardSampler
from diloco.train.loop import MetricsLog, StepClock, train_config_from_json
from diloco.train.model import build_model


def ring_allreduce_bytes(world: int, gradient_bytes: int) -> float:
    """Bytes one worker sends and receives per all-reduce in a ring."""
    return 2 * (world - 1) / world * gradient_bytes


def save(model, path: Path, **metadata) -> None:
    tmp = path.with_suffix(".tmp")
    save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, str(tmp),
              metadata={k: str(v) for k, v in metadata.items()})
    os.replace(tmp, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="one data-parallel worker (started by `diloco run --mode dp`)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--train-config", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--speed", type=float, default=1.0)
    p.add_argument("--max-steps", type=int)
    p.add_argument("--duration", type=float)
    p.add_argument("--snapshot-every", type=int, default=0, help="steps between snapshots (rank 0)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    cfg = train_config_from_json(args.train_config.read_text())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world, timeout=timedelta(seconds=120))
    model = build_model(cfg.model, cfg.seed)
    optimizer = make_inner_optimizer(model, cfg)
    params = [q for q in model.parameters() if q.requires_grad]
    numel = sum(q.numel() for q in params)
    corpus = Corpus.from_config(cfg)
    sampler = ShardSampler(corpus.train, args.rank, args.world, cfg.model.seq_len, cfg.batch_size, cfg.seed)
    clock, log = StepClock(args.speed), MetricsLog(args.out.parent / "metrics" / f"learner-{args.rank}.jsonl")
    snapshots = args.out / "snapshots"
    snapshots.mkdir(parents=True, exist_ok=True)
    flat = torch.zeros(numel + 1)  # gradients plus one slot for the stop vote, in a single all-reduce
    tokens_per_step, step, started = cfg.tokens_per_step(), 0, time.monotonic()
    while args.max_steps is None or step < args.max_steps:
        t0 = clock.start()
        x, y = sampler.next_batch()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        busy = clock.finish(t0)  # the all-reduce below waits for the slowest worker: not this worker's own speed
        torch.cat([q.grad.reshape(-1) for q in params], out=flat[:numel])
        flat[numel] = float(args.rank == 0 and args.duration is not None and time.monotonic() - started >= args.duration)
        dist.all_reduce(flat)
        offset = 0
        for q in params:
            q.grad.copy_(flat[offset : offset + q.numel()].view_as(q) / args.world)
            offset += q.numel()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        step += 1
        log.write(t=time.time(), step=step, loss=loss.item(), tokens=step * tokens_per_step, busy=busy,
                  tokens_per_second=tokens_per_step / busy, pushes=step, applied=step)
        if args.rank == 0 and args.snapshot_every and step % args.snapshot_every == 0:
            save(model, snapshots / f"{time.monotonic() - started:010.3f}.safetensors",
                 seconds=round(time.monotonic() - started, 3), tokens_trained=step * tokens_per_step * args.world,
                 tokens_merged=step * tokens_per_step * args.world)
        if flat[numel] > 0:
            break
    log.close()
    wire = args.world * ring_allreduce_bytes(args.world, 4 * numel) * step
    summary = {"id": f"learner-{args.rank}", "steps": step, "tokens": step * tokens_per_step, "speed": args.speed,
               "pushes": step, "applied": step, "busy_seconds_median": sorted(clock.busy)[len(clock.busy) // 2],
               "wall_seconds": time.monotonic() - started}
    (args.out.parent / "learners").mkdir(exist_ok=True)
    (args.out.parent / "learners" / f"learner-{args.rank}.json").write_text(json.dumps(summary, indent=2))
    if args.rank == 0:
        save(model, args.out / "model.safetensors")
        save(model, snapshots / f"{time.monotonic() - started:010.3f}.safetensors",
             seconds=round(time.monotonic() - started, 3), tokens_trained=step * tokens_per_step * args.world,
             tokens_merged=step * tokens_per_step * args.world)
        (args.out / "dp.json").write_text(json.dumps({"steps": step, "wire_bytes": wire, "parameters": numel}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
