"""Atomic, durable file writes: a temporary file, fsynced, renamed over the target. A crash leaves old or new."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file


def fsync_dir(folder: Path) -> None:
    """Make renames inside `folder` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json(path: Path, obj, indent: int | None = None) -> None:
    write_bytes(path, json.dumps(obj, indent=indent).encode())


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> None:
    """A safetensors file; metadata values are stored as strings."""
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(tmp),
              metadata={k: str(v) for k, v in (metadata or {}).items()})
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
