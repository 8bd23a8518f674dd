"""A Hugging Face `Trainer` as one learner of a run, with one line: `Trainer(..., callbacks=[DiLoCoCallback(...)])`.

At train begin the callback joins (the model's values become the global model's; H, fragments and codec come from
the syncer), after every optimizer step it tells the learner the tokens of the micro-batches that made the step,
it stops the Trainer when the run's budget is spent and leaves the run when training ends, or after the step in
progress on SIGTERM (a scheduler stopping or preempting the job), pushing what it has. Every checkpoint the
Trainer writes carries `diloco_learner.json` (the learner's id, its step and the fragment versions it held), so
`trainer.train(resume_from_checkpoint=...)` rejoins the same run under the same id. Under torchrun (DDP) the
Trainer's ranks are one learner, an island: rank 0 talks to the syncer.

Tokens are counted by a forward pre-hook on the model, on training-mode calls only (evaluation is not counted):
per micro-batch, the attention_mask's sum, else the labels other than -100, else every input id
(`diloco.integrations.tokens`); `count_tokens=` replaces the rule (it receives the model's keyword arguments).
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Callable

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from diloco.integrations import lines, rejoin
from diloco.integrations.budget_lr import Schedule
from diloco.integrations.driver import LearnerDriver, island_group


class DiLoCoCallback(TrainerCallback):
    """Joins a `transformers.Trainer` to a diloco run as learner `learner_id`.

    Args:
        syncer: the syncer's "host:port" ("A:port,B:port" for a sharded syncer).
        learner_id: a stable name; a resumed Trainer rejoins under the id its checkpoint names.
        token: the run's shared secret (`diloco syncer --token`).
        connect_timeout: seconds to keep trying to reach the syncer at train begin before raising SyncerError.
        lr_schedule: a function of the run's budget progress (0..1) giving a factor on the learning rate, e.g.
            `budget_lr.decay_tail()`; it multiplies the Trainer's own schedule (use "constant" or
            "constant_with_warmup" to let the budget alone decay it). Needs a syncer with --tokens or --duration.
        count_tokens: the tokens of one micro-batch, from the model's keyword arguments (default: the module's rule).
        finish_timeout: seconds the final pushes may take at train end (None: as long as they make progress).
        transport_options: more `GrpcTransport` arguments (tls, tls_ca, stall_timeout, ...).
        learner_options: more `Learner` arguments (embedding_names, ...).
    """

    def __init__(self, syncer: str, learner_id: str, token: str = "", *, connect_timeout: float = 30.0,
                 lr_schedule: Schedule | None = None, count_tokens: Callable[[dict], int] | None = None,
                 finish_timeout: float | None = 300.0, transport_options: dict | None = None,
                 learner_options: dict | None = None):
        self.driver = LearnerDriver(syncer, learner_id, token, connect_timeout=connect_timeout,
                                    lr_schedule=lr_schedule, count_tokens=count_tokens, finish_timeout=finish_timeout,
                                    transport_options=transport_options, learner_options=learner_options)
        self._hook = None
        self._loss: float | None = None
        self._sigterm = False
        self._previous_sigterm = None
        """The SIGTERM handler before train begin, while this callback's is set."""

    @property
    def learner(self):
        """The `Learner` of the current (or last) train() call; None before the first."""
        return self.driver.learner

    # ---- train begin: join --------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        if model is None:
            raise ValueError("DiLoCoCallback needs the Trainer's model at train begin, and none was given")
        resumed, source, log = None, "", lines.logger()
        if state.global_step > 0:  # resumed: the Trainer names no folder, but it names them by step
            folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
            source = str(folder)
            resumed = rejoin.read(folder)
            if resumed is None:
                log.warning("learner %s resumes at step %d without %s in %s: it rejoins under the id it was given",
                            self.driver.learner_id, state.global_step, rejoin.RECORD_FILE, folder)
        if args.load_best_model_at_end:
            log.warning("load_best_model_at_end loads a local checkpoint after this learner has left the run; the "
                        "run's model is the syncer's (model.safetensors in its --state)")
        self._remove_hook()
        self.driver.join(model, resumed=resumed, source=source, process_group=island_group(), optimizer=optimizer,
                         scheduler=lr_scheduler)
        self._hook = model.register_forward_pre_hook(self._count, with_kwargs=True)
        self._loss = None
        self._listen_for_sigterm()

    def _listen_for_sigterm(self) -> None:
        """On SIGTERM the Trainer stops after the step in progress and the learner pushes what it has and leaves,
        as `diloco learner` does; train() then returns. The handler that was there before is set back at the
        signal (a second SIGTERM does what it always did) and at train end. Only the main thread can set one."""
        self._sigterm = False
        if threading.current_thread() is not threading.main_thread():
            return
        self._restore_sigterm()
        self._previous_sigterm = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum, frame):
            self._sigterm = True  # acted on between steps: no logging or I/O in a signal handler
            self._restore_sigterm()

        signal.signal(signal.SIGTERM, on_sigterm)

    def _restore_sigterm(self) -> None:
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None

    def _count(self, module, args, kwargs):
        if module.training and self.driver.joined:
            self.driver.add(kwargs if kwargs else args)

    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    # ---- every optimizer step -----------------------------------------------------------------------------
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:  # the Trainer's averaged training loss, shown on the syncer's dashboard
            self._loss = float(logs["loss"])

    def on_step_end(self, args, state, control, **kwargs):
        if not self.driver.joined:
            return
        if self.driver.step(state.global_step, loss=self._loss):
            control.should_training_stop = True  # the run's token or time budget is spent
        learner, leave = self.driver.learner, self._sigterm
        if learner.island is not None:  # the ranks stop together, or their collectives would part ways
            leave = learner.island.any(leave)
        if leave and not control.should_training_stop:
            if learner.leader:
                lines.logger().info("learner %s got SIGTERM: it pushes what it has and leaves the run",
                                    self.driver.learner_id)
            control.should_training_stop = True

    # ---- checkpoints ---------------------------------------------------------------------------------------
    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if args.should_save and self.driver.learner is not None and folder.is_dir():
            rejoin.write(folder, self.driver.record(state.global_step))

    # ---- train end: leave ----------------------------------------------------------------------------------
    def on_epoch_end(self, args, state, control, **kwargs):
        # Training stops here (max_steps, the budget, early stopping): push what is left now, before the Trainer
        # may load its best local checkpoint into the model (load_best_model_at_end).
        if control.should_training_stop:
            self._leave(push=True)

    def on_train_end(self, args, state, control, **kwargs):
        # The data ran out without a stop: the model holds the last step's values unless the best checkpoint was
        # loaded over them, which must not be pushed as this learner's progress.
        replaced = args.load_best_model_at_end and state.best_model_checkpoint is not None
        if replaced and self.driver.joined:
            lines.logger().warning("learner %s leaves without pushing its last steps: the Trainer loaded %s over "
                                   "them", self.driver.learner_id, state.best_model_checkpoint)
        self._leave(push=not replaced)

    def _leave(self, push: bool) -> None:
        try:
            self.driver.finish() if push else self.driver.close()
        finally:
            self._remove_hook()
            self._restore_sigterm()


__all__ = ["DiLoCoCallback"]
