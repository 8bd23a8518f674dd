"""Atomic, durable file writes: a temporary file, fsynced, renamed over the target. A crash leaves old or new.

The writers return the written file's (size, SHA-256 hex digest), which the syncer's manifest records so that a
damaged file is found on load."""

from __future__ import annotations

import errno as errno_codes
import hashlib
import json
import os
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

HASH_CHUNK = 1 << 20


def fsync_dir(folder: Path) -> None:
    """Make renames inside `folder` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_digest(path: Path) -> tuple[int, str]:
    """(size, SHA-256 hex) of a file, read in chunks."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def write_bytes(path: Path, data: bytes) -> tuple[int, str]:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(data), hashlib.sha256(data).hexdigest()


def write_json(path: Path, obj, indent: int | None = None) -> tuple[int, str]:
    return write_bytes(path, json.dumps(obj, indent=indent).encode())


def _as_os_error(e: Exception, path: Path) -> OSError:
    """safetensors reports I/O failures as its own error type, with the errno only in the text: an OSError
    (errno, path) instead, so that callers handle a full or read-only disk in one place."""
    m = re.search(r"os error (\d+)", str(e))
    code = int(m.group(1)) if m else errno_codes.EIO
    return OSError(code, os.strerror(code), str(path))


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> tuple[int, str]:
    """A safetensors file; metadata values are stored as strings. I/O failures raise OSError naming the path."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(tmp),
                  metadata={k: str(v) for k, v in (metadata or {}).items()})
    except OSError:
        raise
    except Exception as e:  # safetensors' SafetensorError
        if "os error" not in str(e) and "I/O error" not in str(e):
            raise
        raise _as_os_error(e, tmp) from e
    digest = file_digest(tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return digest
