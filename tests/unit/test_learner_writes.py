"""Merged values written into a fragment's tensors in place (learner/writes.py): the fused writes give, bit for bit,
what the same arithmetic gives tensor by tensor, whatever the tensors' dtypes and layouts."""

import pytest
import torch

from diloco.learner import writes


def fragment_tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(7, 5, generator=g), torch.randn(33, generator=g).to(torch.bfloat16),
            torch.randn(4, 6, generator=g).t(), torch.randn(1, generator=g)]  # a transposed view: not contiguous


@pytest.mark.parametrize("kind", ["copy", "keep", "blend"])
def test_a_fused_write_is_the_tensor_by_tensor_arithmetic(kind):
    tensors = fragment_tensors()
    numel = sum(t.numel() for t in tensors)
    g = torch.Generator().manual_seed(1)
    values, taken = torch.randn(numel, generator=g), torch.randn(numel, generator=g)
    expected, offset = [], 0
    for t in tensors:
        new = values[offset : offset + t.numel()].view(t.shape)
        old = taken[offset : offset + t.numel()].view(t.shape)
        e = t.clone()
        if kind == "keep":
            e.sub_(old).add_(new)
        elif kind == "blend":
            e.mul_(0.3).add_(new, alpha=1 - 0.3)
        else:
            e.copy_(new)
        expected.append(e)
        offset += t.numel()
    writes.write(tensors, values, taken if kind == "keep" else None, 0.3 if kind == "blend" else None)
    for t, e in zip(tensors, expected):
        assert t.dtype == e.dtype and torch.equal(t, e)


def test_gains_added_a_chunk_at_a_time_land_on_the_right_values():
    tensors = fragment_tensors()
    numel = sum(t.numel() for t in tensors)
    gain = torch.randn(numel, generator=torch.Generator().manual_seed(2))
    expected = [t + g.to(t.dtype) if t.dtype == torch.float32 else t + g
                for t, g in zip(tensors, writes.spans(tensors, gain))]
    chunks = [(lo, min(lo + 10, numel), gain[lo : min(lo + 10, numel)]) for lo in range(0, numel, 10)]
    writes.add_gains(tensors, chunks)  # chunks of 10 values cross every tensor boundary
    for t, e in zip(tensors, expected):
        assert torch.allclose(t.float(), e.float(), rtol=0, atol=1e-6 if t.dtype == torch.float32 else 2e-2)
