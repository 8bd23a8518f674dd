"""A learner's own checkpoint of its inner optimizer, so that a learner restarted under its id resumes its AdamW
moments instead of starting them from zero (the global model itself comes back from the syncer on join)."""

from __future__ import annotations

import io
import logging
import time
from pathlib import Path

import torch

from diloco.atomic import write_bytes

log = logging.getLogger("diloco.learner")
SAVE_EVERY_SECONDS = 30.0
"""How often the checkpoint is written while training (and once more when the learner finishes)."""


class OptimizerCheckpoint:
    """Saves `optimizer`'s state to `path` every SAVE_EVERY_SECONDS and at the end; `resume` loads it back."""

    def __init__(self, path: Path, learner_id: str, optimizer: torch.optim.Optimizer):
        self.path, self.learner_id, self.optimizer = Path(path), learner_id, optimizer
        self.saved_at = time.monotonic()

    def resume(self) -> bool:
        """Load the saved state if there is one for this learner; a damaged or foreign file is reported and left
        alone (the learner then starts its moments afresh: nothing else depends on them)."""
        if not self.path.exists():
            return False
        try:
            saved = torch.load(io.BytesIO(self.path.read_bytes()), weights_only=True)
            if not isinstance(saved, dict) or saved.get("learner_id") != self.learner_id:
                raise ValueError(f"it belongs to learner {saved.get('learner_id') if isinstance(saved, dict) else '?'!r}")
            check_shapes(self.optimizer, saved["optimizer"])
            self.optimizer.load_state_dict(saved["optimizer"])
        except Exception as e:  # a disk can lie: any failure means "no usable state", said once
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            log.warning("not resuming the inner optimizer from %s (%s): its moments start afresh", self.path, reason)
            return False
        log.info("resumed the inner optimizer's state from %s", self.path)
        return True

    def maybe_save(self, force: bool = False) -> None:
        if not force and time.monotonic() - self.saved_at < SAVE_EVERY_SECONDS:
            return
        buffer = io.BytesIO()
        torch.save({"learner_id": self.learner_id, "optimizer": self.optimizer.state_dict()}, buffer)
        try:
            write_bytes(self.path, buffer.getvalue())
        except OSError as e:
            log.warning("could not save the inner optimizer to %s: %s", self.path, e)
        self.saved_at = time.monotonic()


def check_shapes(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Every saved per-parameter tensor has its parameter's shape (load_state_dict checks only their number)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, per_param in state["state"].items():
        if not isinstance(index, int) or not 0 <= index < len(params):
            raise ValueError(f"its state names parameter {index!r}, which this model does not have")
        for name, value in per_param.items():
            if torch.is_tensor(value) and value.dim() > 0 and value.shape != params[index].shape:
                raise ValueError(f"its {name} of parameter {index} is {list(value.shape)}, the model's "
                                 f"{list(params[index].shape)}: another model")
