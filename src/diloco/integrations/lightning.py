"""A Lightning `Trainer` as one learner of a run: `lightning.Trainer(callbacks=[DiLoCoCallback(...)])`.

At train start the callback joins (the LightningModule's values become the global model's), after every optimizer
step it tells the learner the tokens of the batches that made the step (`accumulate_grad_batches` included), it
stops the Trainer when the run's budget is spent and leaves the run at train end, or on SIGTERM (which Lightning
turns into the end of fit() after the batch in progress), pushing what it has first. Its state (the learner's id,
step and the fragment versions it held) is saved in every Lightning checkpoint, so `trainer.fit(..., ckpt_path=...)`
rejoins the same run under the same id. With the DDP strategy the Trainer's ranks are one learner, an island:
rank 0 talks to the syncer.

Tokens per batch: a dict batch by the rule of `diloco.integrations.tokens` (attention_mask's sum, else labels
other than -100, else input_ids), a tensor batch its elements, a tuple or list batch its first tensor's elements;
`count_tokens=` replaces the rule (it receives the batch).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable

import lightning.pytorch as pl
import torch

from diloco.integrations import lines, rejoin
from diloco.integrations.budget_lr import Schedule
from diloco.integrations.driver import LearnerDriver, island_group


class DiLoCoCallback(pl.Callback):
    """Joins a `lightning.Trainer` to a diloco run as learner `learner_id`; the arguments are those of
    `diloco.integrations.transformers.DiLoCoCallback`, except that `count_tokens` receives the batch. `lr_schedule`
    multiplies a LambdaLR scheduler's factor, or with no scheduler sets the rate itself."""

    def __init__(self, syncer: str, learner_id: str, token: str = "", *, connect_timeout: float = 30.0,
                 lr_schedule: Schedule | None = None, count_tokens: Callable[[object], int] | None = None,
                 finish_timeout: float | None = 300.0, transport_options: dict | None = None,
                 learner_options: dict | None = None):
        self.driver = LearnerDriver(syncer, learner_id, token, connect_timeout=connect_timeout,
                                    lr_schedule=lr_schedule, count_tokens=count_tokens, finish_timeout=finish_timeout,
                                    transport_options=transport_options, learner_options=learner_options)
        self._restored: rejoin.RejoinRecord | None = None
        self._step_seen = 0

    @property
    def learner(self):
        """The `Learner` of the current (or last) fit; None before the first."""
        return self.driver.learner

    # ---- train start: join --------------------------------------------------------------------------------
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizers = trainer.optimizers
        if self.driver.lr_schedule is not None and len(optimizers) != 1:
            raise ValueError(f"lr_schedule drives one optimizer, and this LightningModule has {len(optimizers)}: "
                             f"drop lr_schedule, or set the rate from learner.budget_progress yourself")
        schedulers = [c.scheduler for c in trainer.lr_scheduler_configs]
        if self.driver.lr_schedule is not None and len(schedulers) > 1:
            raise ValueError(f"lr_schedule follows the budget through at most one scheduler, and this "
                             f"LightningModule has {len(schedulers)}: drop lr_schedule or all but one")
        resumed = self._restored if trainer.ckpt_path else None
        self.driver.join(pl_module, resumed=resumed, source=str(trainer.ckpt_path or ""),
                         process_group=island_group(), optimizer=optimizers[0] if optimizers else None,
                         scheduler=schedulers[0] if schedulers else None)
        self._step_seen = trainer.global_step

    # ---- every batch, and every optimizer step ------------------------------------------------------------
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        if not self.driver.joined:
            return
        self.driver.add(batch)
        if trainer.global_step == self._step_seen:
            return  # gradients accumulate: the optimizer has not stepped yet
        self._step_seen = trainer.global_step
        if self.driver.step(trainer.global_step, loss=_loss(outputs)):
            trainer.should_stop = True  # the run's token or time budget is spent

    # ---- checkpoints ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        if self.driver.learner is None:
            return self._restored.to_json() if self._restored else {}
        return self.driver.record(self._step_seen).to_json()

    def load_state_dict(self, state_dict: dict) -> None:
        self._restored = rejoin.RejoinRecord.from_json(state_dict, "the Lightning checkpoint") if state_dict else None

    # ---- train end: leave ----------------------------------------------------------------------------------
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.driver.finish()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if _sigterm(exception):  # raised between whole steps: the values are a step's, as at train end
            if self.driver.joined and self.driver.learner.leader:
                lines.logger().info("learner %s got SIGTERM: it pushes what it has and leaves the run",
                                    self.driver.learner_id)
            self.driver.finish()
        else:
            self.driver.close()  # leave without pushing: the values may be half-updated


def _sigterm(exception: BaseException) -> bool:
    """Lightning's answer to SIGTERM: it ends fit() with SIGTERMException after the batch in progress."""
    try:
        from lightning.pytorch.utilities.exceptions import SIGTERMException
    except ImportError:  # a Lightning without it ends fit() on SIGTERM some other way
        return False
    return isinstance(exception, SIGTERMException)


def _loss(outputs) -> float | None:
    """The training step's loss, for the syncer's dashboard."""
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    return float(loss.detach()) if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


__all__ = ["DiLoCoCallback"]
