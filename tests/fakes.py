"""What many tests share: a clock set by hand, the smallest model a run takes, one inner step of a toy task, a syncer
core with a durable store, and /status documents made by hand."""

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


def token_step(model: nn.Module, optimizer: torch.optim.Optimizer, vocab: int, batch: int = 64) -> torch.Tensor:
    """One optimizer step of a model of tokens (0..vocab) learning to predict each token itself; returns the loss."""
    x = torch.randint(0, vocab, (batch,))
    loss = nn.functional.cross_entropy(model(x), x)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.detach()


def stored_core(store, clock_value: float = 100.0, **overrides):
    """A SyncerCore of 2 learners, 3 fragments, H = 6, fp32 pushes and no grace window, writing to `store`;
    verbatim replays accepted, as the constant pushes of `push_value` are (tests/cores.py says why)."""
    from diloco.config import for_mode
    from diloco.syncer.core import SyncerCore

    cfg = for_mode("decoupled", 2, fragments=3, sync_every=6, codec="fp32", grace=0.0,
                   **{"refuse_replays": False, **overrides})
    return SyncerCore(cfg, clock=lambda: clock_value, store=store)


def push_value(core, lid, session, seq, fragment=1, value=0.5):
    """Push Δ = `value` everywhere in `fragment`, 4 steps and 400 tokens, on the fragment's current version."""
    from diloco.algorithm import codec

    n = core.fragments[fragment].fragment.numel
    return core.push(lid, session, seq, fragment, core.fragments[fragment].version, 4, 400,
                     codec.encode(torch.full((n,), value), "fp32"))


def status_at(t: float, learners=(), rounds=(), evals=(), faults=()) -> dict:
    """A syncer's /status as it reads `t` seconds after its start (what the dashboard's history samples)."""
    return {"uptime_seconds": t, "started_unix": 1000.0, "rounds": int(t), "tokens_trained": int(10 * t),
            "tokens_merged": int(5 * t), "learners": list(learners), "recent_rounds": list(rounds),
            "global_eval": list(evals), "faults": list(faults)}


def learner(name: str, step: int, loss=2.0, rate=100.0, state="live") -> dict:
    """One learner's row of /status."""
    return {"id": name, "state": state, "step": step, "loss": loss, "tokens_per_second": rate}
