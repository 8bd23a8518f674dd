"""What many tests share: a clock set by hand, and the smallest model a run takes."""

import torch
from torch import nn


class Clock:
    """A clock that moves only when a test sets `now` (seconds)."""

    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


class TinyNet(nn.Module):
    """An 8×4 embedding (fragment 0: 32 values) and a 4 → `width` linear layer, the same values every time."""

    def __init__(self, width: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(8, 4)
        self.lin = nn.Linear(4, width)
