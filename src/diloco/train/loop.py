"""The built-in trainer: one readable loop per learner process, used by `diloco learner` and `diloco run`."""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from diloco.learner.learner import Learner
from diloco.learner.transport import Transport
from diloco.train.train_config import ModelConfig, TrainConfig, lr_at, make_inner_optimizer
from diloco.train.data import Corpus, ShardSampler
from diloco.train.model import build_model
from diloco.train.optimizer_state import OptimizerCheckpoint

log = logging.getLogger("diloco.learner")
PROGRESS_EVERY_SECONDS = 60.0
"""How often a learner logs a line of progress (at INFO, the default level of `diloco learner`)."""


@dataclass
class WorkerOptions:
    learner_id: str
    """Stable name of this learner; re-joining under it resumes its ledger and data position."""
    shard: int = 0
    """Which part of the training data this learner reads."""
    num_shards: int = 1
    """Into how many disjoint parts the training data is cut."""
    speed: float = 1.0
    """Emulated hardware speed: each step is stretched to 1/speed of its compute time (0.25 = four times slower)."""
    pace: float | None = None
    """Seconds one step takes at speed 1: every step is padded to pace/speed, so the learner's capacity is known in
    advance and does not change when a neighbour on the same machine dies (None: steps take what they take)."""
    max_steps: int | None = None
    """Stop after this many inner steps even if the syncer has not said stop."""
    metrics_path: Path | None = None
    """Where to append one JSON line per step."""
    tensorboard: Path | None = None
    """Also write the per-step curves as TensorBoard event files into this directory."""
    stop: threading.Event | None = None
    """Set (e.g. on SIGTERM) to leave the run after the current step, pushing what is left first."""
    optimizer_checkpoint: Path | None = None
    """Where this learner keeps its inner optimizer's state (every 30 s and at the end), and resumes it from when
    it restarts under its id (train/optimizer_state.py); None keeps none."""


def train_config_to_json(cfg: TrainConfig) -> str:
    return json.dumps(asdict(cfg), indent=2)


def train_config_from_json(text: str) -> TrainConfig:
    raw = json.loads(text)
    raw["model"] = ModelConfig(**raw.get("model", {}))
    if "betas" in raw:
        raw["betas"] = tuple(raw["betas"])
    return TrainConfig(**raw)


@dataclass
class StepClock:
    """Measures a step's busy time and stretches it to the emulated speed: to 1/speed of its compute time, or with
    a `pace` to exactly pace/speed seconds (a step whose compute alone takes longer overruns, and is counted)."""

    speed: float = 1.0
    pace: float | None = None
    busy: list[float] = field(default_factory=list)
    overruns: int = 0
    """Paced steps whose compute took longer than the pace allowed."""

    def start(self) -> float:
        return time.monotonic()

    def finish(self, started: float) -> float:
        compute = time.monotonic() - started
        if self.pace:
            target = self.pace / self.speed
            if compute > target:
                self.overruns += 1
                if self.overruns in (1, 10, 100, 1000):
                    log.warning("step took %.3f s of compute, over its pace of %.3f s (%d such steps): the "
                                "machine is busier than the pace allows; give a larger --pace", compute, target,
                                self.overruns)
            else:
                time.sleep(target - compute)
        elif self.speed < 1.0:
            time.sleep(compute * (1.0 / self.speed - 1.0))
        busy = time.monotonic() - started
        self.busy.append(busy)
        return busy


TENSORBOARD_SCALARS = ("loss", "tokens_per_second", "pushes", "applied")


def tensorboard_writer(log_dir: Path):
    """A TensorBoard SummaryWriter for `log_dir`, or a clear error when the tensorboard package is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ValueError("--tensorboard needs the tensorboard package: pip install 'diloco[tensorboard]'") from None
    return SummaryWriter(log_dir=str(log_dir))


class MetricsLog:
    """One JSON object per line; flushed at each write so a crash loses at most the line being written. With a
    TensorBoard directory, the step's loss, tokens/s, pushes and applied fragments go there too."""

    def __init__(self, path: Path | None, tensorboard: Path | None = None):
        self._file = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", buffering=1)
        self._board = tensorboard_writer(tensorboard) if tensorboard is not None else None

    def write(self, **record) -> None:
        if self._file:
            self._file.write(json.dumps(record) + "\n")
        if self._board is not None:
            for key in TENSORBOARD_SCALARS:
                if record.get(key) is not None:
                    self._board.add_scalar(f"learner/{key}", record[key], global_step=record["step"],
                                           walltime=record.get("t"))

    def close(self) -> None:
        if self._file:
            self._file.close()
        if self._board is not None:
            self._board.close()


def train_step(model, optimizer, x, y, step: int, cfg: TrainConfig, progress: float | None = None) -> float:
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, cfg, progress)
    _, loss = model(x, y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if cfg.grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    return loss.item()


def run_learner(cfg: TrainConfig, transport: Transport | None, opts: WorkerOptions, corpus: Corpus | None = None,
                device: torch.device | str = "cpu", process_group=None) -> dict:
    """Train until the syncer says stop (or max_steps); returns this learner's summary.

    With `process_group` this process is one rank of a learner made of several (torchrun): the model is wrapped in
    DistributedDataParallel, each rank reads its own part of the learner's shard, and rank 0 talks to the syncer
    (the other ranks pass transport=None)."""
    corpus = corpus or Corpus.from_config(cfg)
    device = torch.device(device)
    model = build_model(cfg.model, cfg.seed).to(device)
    rank, ranks = 0, 1
    if process_group is not None:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        rank, ranks = dist.get_rank(process_group), dist.get_world_size(process_group)
        model = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                        process_group=process_group)
    learner = Learner(model, transport, opts.learner_id, speed=opts.speed, process_group=process_group)
    optimizer = make_inner_optimizer(model, cfg)
    checkpoint = None
    if opts.optimizer_checkpoint is not None:
        path = opts.optimizer_checkpoint  # DDP ranks hold equal states, but each its own: a file per rank
        path = path if ranks == 1 else path.with_name(f"{path.stem}.rank{rank}{path.suffix}")
        checkpoint = OptimizerCheckpoint(path, opts.learner_id, optimizer)
        checkpoint.resume()
    sampler = ShardSampler(corpus.train, opts.shard * ranks + rank, opts.num_shards * ranks, cfg.model.seq_len,
                           cfg.batch_size, cfg.seed, position=learner.data_position)
    clock = StepClock(opts.speed, opts.pace)
    metrics = MetricsLog(opts.metrics_path if rank == 0 else None, opts.tensorboard if rank == 0 else None)
    tokens_per_step = cfg.tokens_per_step()
    started = time.time()
    logged_at, logged_step = time.monotonic(), 0
    try:
        while not learner.should_stop and (opts.max_steps is None or learner.step_count < opts.max_steps):
            leave = opts.stop is not None and opts.stop.is_set()
            if learner.island is not None:  # the ranks leave together, or their collectives would part ways
                leave = learner.island.any(leave)
            if leave:
                break
            t0 = clock.start()
            x, y = (t.to(device, non_blocking=True) for t in sampler.next_batch())
            progress = learner.step_count / opts.max_steps if opts.max_steps else learner.budget_progress
            loss = train_step(model, optimizer, x, y, learner.step_count, cfg, progress)
            busy = clock.finish(t0)
            learner.step(tokens_per_step, loss=loss, data_position=sampler.position)
            if checkpoint is not None:
                checkpoint.maybe_save()
            if rank == 0 and time.monotonic() - logged_at >= PROGRESS_EVERY_SECONDS:
                rate = (learner.step_count - logged_step) / (time.monotonic() - logged_at)
                log.info("step %d (%.2f a second), loss %.4f, %d pushes, %d merged fragments applied, %d refused%s",
                         learner.step_count, rate, loss, learner.pushes, learner.applied, learner.refused,
                         "" if learner.budget_progress is None else f", {100 * learner.budget_progress:.0f}% of "
                                                                    f"the run's budget")
                logged_at, logged_step = time.monotonic(), learner.step_count
            metrics.write(t=time.time(), step=learner.step_count, loss=loss, tokens=learner.tokens, busy=busy,
                      tokens_per_second=tokens_per_step * ranks / busy, pushes=learner.pushes, applied=learner.applied,
                      versions=learner.global_fragment_versions(), learner_host_ms=1e3 * learner.costs.recent[-1])
        learner.finish()
        if checkpoint is not None:
            checkpoint.maybe_save(force=True)
    except BaseException:
        learner.close()
        raise
    finally:
        metrics.close()
    busy = sorted(clock.busy) or [float("nan")]
    return {
        "id": opts.learner_id, "steps": learner.step_count, "tokens": learner.tokens, "pushes": learner.pushes,
        "applied": learner.applied, "skipped": learner.skipped, "flushed": learner.flushed, "refused": learner.refused,
        "realigned": learner.realigned, "schedule_position": learner.schedule_position, "speed": opts.speed,
        "pace": opts.pace, "pace_overruns": clock.overruns, "busy_seconds_median": busy[len(busy) // 2], "wall_seconds": time.time() - started,
        "wire_bytes": transport.wire_bytes if transport is not None else 0, "ranks": ranks,
        "learner_costs": learner.costs.summary(),
    }
