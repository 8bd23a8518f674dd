"""Atomic, durable file writes: a temporary file, fsynced, renamed over the target. A crash leaves old or new.

The writers return the written file's (size, SHA-256 hex digest), which the syncer's manifest records so that a
damaged file is found on load. Every file is created readable by its owner alone (0600, given to open: no window
in which another user could open it), and `private_folder` makes folders 0700: the syncer's state holds its
learners' progress and the model."""

from __future__ import annotations

import errno as errno_codes
import hashlib
import json
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch
from safetensors.torch import save_file

SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                      torch.bool: "BOOL"}

HASH_CHUNK = 1 << 20
FILE_MODE = 0o600
FOLDER_MODE = 0o700


def private_open(path: Path, flags: int = os.O_WRONLY | os.O_CREAT | os.O_TRUNC):
    """`open` for writing, creating the file 0600. A leftover temporary file (of another mode, perhaps opened by
    someone meanwhile) is removed first, so what is written goes to a new file nobody else holds."""
    path = Path(path)
    if flags & os.O_TRUNC and path.name.endswith(".tmp"):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        flags |= os.O_EXCL
    fd = os.open(path, flags | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0), FILE_MODE)
    return os.fdopen(fd, "ab" if flags & os.O_APPEND else "wb")


def private_opener(path: str, flags: int) -> int:
    """An `opener` for open() and logging's file handlers: files they create are 0600. A FIFO put in their place
    fails at once (ENXIO) instead of blocking the opener until something reads it."""
    return os.open(path, flags | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0), FILE_MODE)


def private_folder(folder: Path, log=None) -> None:
    """`folder` (and missing parents) made 0700 if new; an existing one that group or others may use is tightened
    to its owner alone, logged when it holds files already (others could have read the state, or swapped its
    files). A shared folder (sticky, like /tmp, or another user's) is left as it is, with a warning."""
    folder = Path(folder)
    try:
        folder.mkdir(mode=FOLDER_MODE, parents=True)
        return
    except FileExistsError:
        if not folder.is_dir():
            raise NotADirectoryError(errno_codes.ENOTDIR, "not a folder", str(folder)) from None
    st = folder.stat()
    if not st.st_mode & 0o077:
        return
    if st.st_mode & stat.S_ISVTX or st.st_uid != os.geteuid():
        if log is not None:
            log.warning("%s is a shared folder (mode %o): others may list or replace what is written there; give "
                        "the syncer a folder of its own", folder, st.st_mode & 0o7777)
        return
    os.chmod(folder, st.st_mode & 0o700)
    if log is not None and any(folder.iterdir()):
        log.warning("%s was open to group or others (mode %o): tightened to %o (the syncer's state is for its user "
                    "alone)", folder, st.st_mode & 0o777, st.st_mode & 0o700)


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
    with private_open(tmp) as f:
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
    private_open(tmp).close()  # created 0600 here: safetensors truncates and keeps the mode
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


@dataclass(frozen=True)
class Chunked:
    """A tensor for `save_tensor_stream` given as flat pieces made while it is written (Θ = P + residual of a
    syncer fragment, a piece at a time): it is never whole in memory."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: Callable[[], Iterable[torch.Tensor]]


def save_tensor_stream(path: Path, layout: list[tuple[str, torch.dtype, tuple[int, ...]]],
                       tensors: Iterable[torch.Tensor | Chunked], metadata: dict | None = None) -> tuple[int, str]:
    """A safetensors file written one tensor at a time: `layout` names each tensor's name, dtype and shape in the
    order `tensors` yields them, so a caller can make each one as it is written (the syncer's model: one fragment
    of Θ at a time) instead of holding all at once, as `save_file` needs; a `Chunked` one is written a piece at a
    time. Hashed as it is written. Readable by `safetensors.load_file`. I/O failures raise OSError naming the path."""
    header, offset = {}, 0
    for name, dtype, shape in layout:
        size = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    tmp = path.with_name(path.name + ".tmp")
    digest, size = hashlib.sha256(), 0

    def write(f, data) -> None:
        nonlocal size
        f.write(data)
        digest.update(data)
        size += len(data)

    with private_open(tmp) as f:
        write(f, struct.pack("<Q", len(encoded)))
        write(f, encoded)
        written = 0
        for (name, dtype, shape), t in zip(layout, tensors, strict=True):
            if isinstance(t, Chunked):
                if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                    raise ValueError(f"{name}: {tuple(t.shape)} {t.dtype}, the layout says {tuple(shape)} {dtype}")
                pieces = t.pieces()
            else:
                if tuple(t.shape) != tuple(shape):
                    raise ValueError(f"{name}: shape {tuple(t.shape)}, the layout says {tuple(shape)}")
                pieces = [t]
            expected, got = torch.Size(shape).numel(), 0
            for piece in pieces:
                piece = piece.detach().to("cpu", dtype).contiguous()
                write(f, memoryview(piece.reshape(-1).view(torch.uint8).numpy()))  # bf16 has no numpy type: bytes
                got += piece.numel()
            if got != expected:
                raise ValueError(f"{name}: {got} values written, the layout says {expected}")
            written += got * torch.empty(0, dtype=dtype).element_size()
        if written != offset:
            raise ValueError(f"wrote {written} bytes of tensors, the layout says {offset}")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return size, digest.hexdigest()
