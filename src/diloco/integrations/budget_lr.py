"""A learning rate that follows the run's shared budget progress (`Learner.budget_progress`), so that learners
joining late, or resumed, decay together with the others instead of by their own step counts."""

from __future__ import annotations

from typing import Callable

import torch

Schedule = Callable[[float], float]
"""Budget progress (0 at the start of the run, 1 when its budget is spent) to a factor on the learning rate."""


def decay_tail(final: float = 0.1, tail: float = 0.2) -> Schedule:
    """Hold the learning rate, then decay it linearly to `final` of itself over the last `tail` of the budget
    (the built-in trainer's `--lr-decay`)."""
    if not 0 <= final <= 1 or not 0 < tail <= 1:
        raise ValueError(f"decay_tail needs 0 <= final <= 1 and 0 < tail <= 1, got final={final}, tail={tail}")

    def factor(progress: float) -> float:
        into = (min(max(progress, 0.0), 1.0) - (1 - tail)) / tail
        return 1.0 - (1.0 - final) * min(max(into, 0.0), 1.0)

    return factor


def follow_budget(optimizer: torch.optim.Optimizer, scheduler, schedule: Schedule,
                  progress: Callable[[], float | None]) -> Callable[[], None]:
    """Make `optimizer`'s learning rate follow schedule(progress()). A LambdaLR `scheduler` (what a Hugging Face
    Trainer makes for linear, cosine, constant and their warmups) keeps its own factor, multiplied by the budget's;
    with no scheduler the returned function, called after each optimizer step, sets the rate. None progress (not
    heard from the syncer yet) counts as 0."""
    if not callable(schedule):
        raise ValueError(f"lr_schedule must be a function of the budget progress (0..1) giving a factor on the "
                         f"learning rate, e.g. diloco.integrations.budget_lr.decay_tail(), got {schedule!r}")

    def budget() -> float:
        p = progress()
        return float(schedule(0.0 if p is None else p))

    if scheduler is not None:
        inner = getattr(scheduler, "scheduler", scheduler)  # Accelerate's AcceleratedScheduler wraps one
        if not isinstance(inner, torch.optim.lr_scheduler.LambdaLR):
            raise ValueError(f"lr_schedule follows the budget through a LambdaLR scheduler (a Trainer's linear, cosine "
                             f"or constant schedule), but this one is {type(inner).__name__}: choose one of those, or "
                             f"drop lr_schedule")
        # plain closures: LambdaLR's state_dict skips functions, so checkpoints do not try to pickle them
        inner.lr_lambdas = [_times(fn, budget) for fn in inner.lr_lambdas]
        for group, base, fn in zip(inner.optimizer.param_groups, inner.base_lrs, inner.lr_lambdas):
            group["lr"] = base * fn(inner.last_epoch)  # the next step already at the run's progress
        inner._last_lr = [group["lr"] for group in inner.optimizer.param_groups]
        return lambda: None
    initial = [group["lr"] for group in optimizer.param_groups]

    def update() -> None:
        factor = budget()
        for group, lr in zip(optimizer.param_groups, initial):
            group["lr"] = lr * factor

    update()
    return update


def _times(fn, budget):
    fn = getattr(fn, "scheduled_alone", fn)  # a scheduler reused by a second train(): its own factor, once

    def factor(step):
        return fn(step) * budget()

    factor.scheduled_alone = fn
    return factor
