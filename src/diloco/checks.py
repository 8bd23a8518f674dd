"""Inputs checked before anything starts, each refused with one line that names its flag."""

from __future__ import annotations

import os
from pathlib import Path


class InputError(ValueError):
    """A flag's value that cannot work; the message starts with the flag."""


def writable_dir(flag: str, path: Path) -> None:
    """Create `path` (and its parents) if needed and make sure files can be written into it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise InputError(f"{flag}: cannot write {path}: it exists and is not a folder") from None
    except OSError as e:
        raise InputError(f"{flag}: cannot write {path}: {e.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise InputError(f"{flag}: cannot write {path}: Permission denied")


def writable_file(flag: str, path: Path) -> None:
    """The folder of `path` exists or can be made, and a file can be created there (nothing is written)."""
    if path.is_dir():
        raise InputError(f"{flag}: cannot write {path}: it is a folder")
    writable_dir(flag, path.parent)
    if path.exists() and not os.access(path, os.W_OK):
        raise InputError(f"{flag}: cannot write {path}: Permission denied")


def corpus(train, shards: int) -> None:
    """A corpus of one's own (`--corpus`) that every learner can read a shard of and that leaves held-out text:
    refused here, in the parent, rather than by every process it would have started."""
    if not train.corpus:
        return
    from diloco.train.data import Corpus, ShardSampler, eval_batches

    try:
        data = Corpus.from_config(train)
    except FileNotFoundError as e:
        raise InputError(f"--corpus: {e}") from None
    except OSError as e:
        raise InputError(f"--corpus: cannot read {e.filename}: {e.strerror}") from None
    except ValueError as e:
        raise InputError(f"--corpus: {e}") from None
    try:
        ShardSampler(data.train, shards - 1, shards, train.model.seq_len, train.batch_size, train.seed)
        eval_batches(data.heldout, train.model.seq_len, 1, 1)
    except ValueError as e:
        raise InputError(f"--corpus: {e}") from None


def training(train) -> None:
    """Settings of the built-in trainer that would train nothing, or fail in every learner."""
    import math

    if train.batch_size < 1:
        raise InputError(f"--batch-size must be at least 1, got {train.batch_size}")
    if not 0 < train.lr < math.inf:
        raise InputError(f"--lr must be a positive number, got {train.lr}")
    if train.seed < 0:
        raise InputError(f"--seed must be 0 or more, got {train.seed}")
    if train.warmup_steps < 0:
        raise InputError(f"--warmup-steps must be 0 or more, got {train.warmup_steps}")
    if not 0 <= train.model.z_loss < math.inf:
        raise InputError(f"--z-loss must be 0 or a positive number, got {train.model.z_loss}")
