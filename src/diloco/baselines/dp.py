"""Synchronous data-parallel training, the baseline: gradients all-reduced (gloo) every step (docs/algorithm.md
§5, §9).

Same model, data shards, optimizer and budgets as the learners; one process per worker, launched by `diloco run
--mode dp`. Wire bytes are counted as a ring all-reduce moves them: 2·(M−1)/M × gradient bytes per worker per step.

Like a real data-parallel job it survives failures only by restarting: rank 0 checkpoints every
`--checkpoint-every` steps, and every rank of a restarted job resumes from the newest checkpoint. Each rank's data
position is step × batch_size, so the step alone says where every sampler was.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from diloco.atomic import fsync_dir, save_tensors, write_bytes, write_json
from diloco.train.train_config import lr_at, make_inner_optimizer
from diloco.train.data import Corpus, ShardSampler
from diloco.train.loop import MetricsLog, StepClock, train_config_from_json
from diloco.train.model import build_model


def ring_allreduce_bytes(world: int, gradient_bytes: int) -> float:
    """Bytes one worker sends and receives per all-reduce in a ring."""
    return 2 * (world - 1) / world * gradient_bytes


def save(model, path: Path, **metadata) -> None:
    save_tensors(path, dict(model.named_parameters()), metadata)


# ---- checkpoints: `<out>/checkpoint/step-NNNNNNNNN.pt`, the step in the name so a launcher can read it cheaply ----

def latest_checkpoint(folder: Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint; a save cut short leaves only a `.tmp` file, which is ignored."""
    found = sorted(folder.glob("step-*.pt"))  # zero-padded: name order is step order
    return (int(found[-1].stem.removeprefix("step-")), found[-1]) if found else None


def save_checkpoint(folder: Path, step: int, model, optimizer) -> None:
    """Durable and atomic: a crash at any point leaves the previous checkpoint or this one, never a torn file."""
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"step-{step:09d}.pt"
    buffer = io.BytesIO()
    torch.save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    write_bytes(final, buffer.getvalue())
    fsync_dir(folder)  # make the rename itself durable
    for old in folder.glob("step-*"):
        if old != final:
            old.unlink(missing_ok=True)


def restore(folder: Path, model, optimizer) -> int:
    """Load the newest checkpoint into model and optimizer; returns its step (0 when there is none)."""
    found = latest_checkpoint(folder)
    if found is None:
        return 0
    state = torch.load(found[1], weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


def agree_on_step(step: int) -> None:
    """Every rank must resume from the same checkpoint, or the gradients they average belong to different models."""
    t = torch.tensor([step, -step], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if t[0].item() != step or -t[1].item() != step:
        raise RuntimeError(f"ranks resumed from different steps (between {-t[1].item()} and {t[0].item()})")


def drop_lost_snapshots(folder: Path, step: int) -> None:
    """Snapshots taken after the checkpoint we resume from are of steps the crash lost: not the final trajectory."""
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            taken_at = int((f.metadata() or {}).get("step", 0))
        if taken_at > step:
            path.unlink()


def end_cut_line(path: Path) -> None:
    """A worker killed mid-write may leave half a metrics line; the next line must not be glued to it."""
    if path.exists() and path.stat().st_size:
        with path.open("rb+") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")


def job_clock(path: Path, duration: float | None) -> tuple[float, float | None]:
    """(start, deadline) of the job's training, fixed when it first trains and kept across restarts: a restarted
    job gets neither a fresh budget nor a fresh time axis. Like the syncer's, the clock starts with training, not
    with process startup."""
    if path.exists():
        clock = json.loads(path.read_text())
    else:
        now = time.time()
        clock = {"started_unix": now, "deadline_unix": now + duration if duration else None}
        write_json(path, clock)
    return clock["started_unix"], clock["deadline_unix"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="one data-parallel worker (started by `diloco run --mode dp`)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master-addr", default="127.0.0.1", help="where rank 0 holds the rendezvous (127.0.0.1)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--train-config", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--speed", type=float, default=1.0)
    p.add_argument("--pace", type=float, help="seconds per step at speed 1 that every step is padded to")
    p.add_argument("--tensorboard", type=Path, help="also write this worker's curves into DIR/learner-<rank>")
    p.add_argument("--max-steps", type=int, help="total steps of the job, restarts included")
    p.add_argument("--duration", type=float, help="seconds of training for the whole job, restarts included")
    p.add_argument("--snapshot-every", type=int, default=0, help="steps between snapshots (rank 0)")
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints (rank 0); 0 = never")
    p.add_argument("--restart-count", type=int, default=0, help="restarts of the job so far (recorded in metrics)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    cfg = train_config_from_json(args.train_config.read_text())
    process_started = time.monotonic()
    checkpoints, snapshots = args.out / "checkpoint", args.out / "snapshots"
    snapshots.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master_addr}:{args.port}", rank=args.rank,
                            world_size=args.world, timeout=timedelta(seconds=120))
    model = build_model(cfg.model, cfg.seed)
    optimizer = make_inner_optimizer(model, cfg)
    step = restore(checkpoints, model, optimizer)
    agree_on_step(step)
    if args.rank == 0:
        drop_lost_snapshots(snapshots, step)
    params = [q for q in model.parameters() if q.requires_grad]
    numel = sum(q.numel() for q in params)
    corpus = Corpus.from_config(cfg)
    sampler = ShardSampler(corpus.train, args.rank, args.world, cfg.model.seq_len, cfg.batch_size, cfg.seed,
                           position=step * cfg.batch_size)
    metrics = args.out.parent / "metrics" / f"learner-{args.rank}.jsonl"
    end_cut_line(metrics)
    board = args.tensorboard / f"learner-{args.rank}" if args.tensorboard else None
    clock, log = StepClock(args.speed, args.pace), MetricsLog(metrics, board)
    flat = torch.zeros(numel + 2)  # gradients, rank 0's stop vote and share of the time budget: one all-reduce
    tokens_per_step = cfg.tokens_per_step()
    started, deadline = job_clock(args.out / "clock.json", args.duration) if args.rank == 0 else (0.0, None)

    def snapshot() -> None:
        seconds = round(time.time() - started, 3)
        save(model, snapshots / f"{seconds:010.3f}.safetensors", seconds=seconds, step=step,
             tokens_trained=step * tokens_per_step * args.world, tokens_merged=step * tokens_per_step * args.world)

    time_progress = None  # only rank 0 keeps the job's clock; the others learn it with each all-reduce
    while args.max_steps is None or step < args.max_steps:
        t0 = clock.start()
        x, y = sampler.next_batch()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg, step / args.max_steps if args.max_steps else time_progress)
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        busy = clock.finish(t0)  # the all-reduce below waits for the slowest worker: not this worker's own speed
        torch.cat([q.grad.reshape(-1) for q in params], out=flat[:numel])
        flat[numel] = float(args.rank == 0 and deadline is not None and time.time() >= deadline)
        flat[numel + 1] = (time.time() - started) / args.duration if args.rank == 0 and args.duration else 0.0
        dist.all_reduce(flat)
        time_progress = float(flat[numel + 1]) if args.duration else None  # every rank decays alike
        offset = 0
        for q in params:
            q.grad.copy_(flat[offset : offset + q.numel()].view_as(q) / args.world)
            offset += q.numel()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        step += 1
        log.write(t=time.time(), step=step, loss=loss.item(), tokens=step * tokens_per_step, busy=busy,
                  tokens_per_second=tokens_per_step / busy, pushes=step, applied=step, restarts=args.restart_count)
        if args.rank == 0 and args.snapshot_every and step % args.snapshot_every == 0:
            snapshot()
        if args.rank == 0 and args.checkpoint_every and step % args.checkpoint_every == 0:
            save_checkpoint(checkpoints, step, model, optimizer)
        if flat[numel] > 0:
            break
    log.close()
    busy = sorted(clock.busy)
    summary = {"id": f"learner-{args.rank}", "steps": step, "tokens": step * tokens_per_step, "speed": args.speed,
               "pace": args.pace, "pace_overruns": clock.overruns, "pushes": step, "applied": step, "busy_seconds_median": busy[len(busy) // 2] if busy else None,
               "wall_seconds": time.monotonic() - process_started, "restarts": args.restart_count}
    (args.out.parent / "learners").mkdir(exist_ok=True)
    (args.out.parent / "learners" / f"learner-{args.rank}.json").write_text(json.dumps(summary, indent=2))
    if args.rank == 0:
        if args.checkpoint_every and step % args.checkpoint_every:  # a worker failing on its way out costs nothing
            save_checkpoint(checkpoints, step, model, optimizer)
        save(model, args.out / "model.safetensors")
        snapshot()
        (args.out / "dp.json").write_text(json.dumps({"steps": step, "parameters": numel, "started_unix": started}))
    # leave together: a rank that tears down gloo while rank 0 still writes its files can abort on exit
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
