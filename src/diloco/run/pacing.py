"""Pacing: a fixed wall time per step, so that each learner's capacity — what goodput divides by — is known before
the run and does not change when a neighbour on the same machine dies and frees its cores."""

from __future__ import annotations

import os
import statistics
import time

import torch

from diloco.train.train_config import TrainConfig

MARGIN = 1.5
"""Pace over the measured step time of a fully loaded machine: jitter must fit inside it, or steps overrun."""
CALIBRATION_STEPS = 6


def measure_step_seconds(train: TrainConfig, steps: int = CALIBRATION_STEPS) -> float:
    """Median seconds of one inner step of the built-in model in this process, on one thread (as learners run)."""
    from diloco.train.data import Corpus, ShardSampler
    from diloco.train.loop import train_step
    from diloco.train.train_config import make_inner_optimizer
    from diloco.train.model import build_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_model(train.model, train.seed)
        optimizer = make_inner_optimizer(model, train)
        sampler = ShardSampler(Corpus.from_config(train).train, 0, 1, train.model.seq_len, train.batch_size, train.seed)
        times = []
        for step in range(steps + 2):  # two warm-up steps
            started = time.monotonic()
            x, y = sampler.next_batch()
            train_step(model, optimizer, x, y, step, train, 0.0)
            times.append(time.monotonic() - started)
        return statistics.median(times[2:])
    finally:
        torch.set_num_threads(threads)


def auto_pace(train: TrainConfig, processes: int, cores: int | None = None) -> float:
    """A pace every learner can hold while all run: the step time on one core, times the processes sharing each
    core, times MARGIN."""
    cores = cores or os.cpu_count() or 1
    return measure_step_seconds(train) * max(1.0, processes / cores) * MARGIN


def parse_pace(text: str | None) -> float | str | None:
    """--pace: seconds, "auto", or "off" (None: not given)."""
    if text is None or text in ("auto", "off"):
        return text
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ValueError(f"--pace must be a positive number of seconds, auto or off, got {text!r}")
    return value


def parse_speeds(text: str | None, learners: int) -> list[float]:
    if not text:
        return [1.0] * learners
    try:
        speeds = [float(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--speeds must be comma-separated numbers like 1,1,0.5,0.25, got {text!r}") from None
    if len(speeds) != learners:
        raise ValueError(f"--speeds lists {len(speeds)} factors for {learners} learners; give one per learner")
    if any(not 0 < s <= 1 for s in speeds):
        raise ValueError(f"speed factors must be in (0, 1] (1 = full speed, 0.25 = four times slower), got {text}")
    return speeds
