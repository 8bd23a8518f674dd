"""Fragment copies between the model's device and host memory that never make the training thread wait.

On a CPU model a snapshot is a plain copy. On CUDA the fragment is first copied on the device (fast; the next
training kernels wait only for that), then to pinned host memory on a side stream; the sender thread waits for
that copy, not the training thread. Merged values come back from pinned memory on the same side stream.
"""

from __future__ import annotations

import torch

_streams: dict[torch.device, "torch.cuda.Stream"] = {}


def _side_stream(device: torch.device):
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device)
    return _streams[device]


class Snapshot:
    """A fragment's values at one step: `device` (fp32, where the model lives) and `host()` (fp32 CPU) once ready."""

    def __init__(self, device_values: torch.Tensor, host_values: torch.Tensor, ready=None):
        self.device_values = device_values
        self._host = host_values
        self._ready = ready

    def device(self) -> torch.Tensor:
        """The device copy, safe to use on the current stream (it was made on the side stream)."""
        if self.device_values.is_cuda:
            self.device_values.record_stream(torch.cuda.current_stream(self.device_values.device))
        return self.device_values

    def host(self) -> torch.Tensor:
        """The host copy; on CUDA this waits for the side stream's copy (call it off the training thread)."""
        if self._ready is not None:
            self._ready.synchronize()
            self._ready = None
        return self._host


def snapshot(tensors: list[torch.Tensor]) -> Snapshot:
    """Copy `tensors` (one fragment, in payload order) into one flat fp32 vector without blocking on the device."""
    device = tensors[0].device
    if device.type != "cuda":
        flat = torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])
        return Snapshot(flat, flat)
    current, side = torch.cuda.current_stream(device), _side_stream(device)
    side.wait_stream(current)  # the step that produced these values comes first
    with torch.cuda.stream(side):
        flat = torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])
        copied = torch.cuda.Event()
        copied.record(side)
        host = torch.empty(flat.numel(), dtype=torch.float32, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(side)
    current.wait_event(copied)  # the next optimizer step may overwrite the parameters only after the device copy
    return Snapshot(flat, host, ready)


def to_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host fp32 values on `device`, copied on the side stream; the training stream waits for the copy, the
    training thread does not (values should be pinned; the receiver pins them for CUDA models)."""
    if device.type != "cuda":
        return values
    current, side = torch.cuda.current_stream(device), _side_stream(device)
    with torch.cuda.stream(side):
        out = values.to(device, non_blocking=True)
    current.wait_stream(side)
    out.record_stream(current)
    return out
