"""Your own PyTorch loop as one learner of a run: three added lines (the Learner, `step`, `finish`).

Start a syncer first:   diloco syncer --listen 127.0.0.1:50051 --state runs/syncer
then one or more of:    python examples/own_loop.py --syncer 127.0.0.1:50051 --id alice
"""

import argparse

import torch
from torch import nn

from diloco import GrpcTransport, Learner


def make_model() -> nn.Module:
    torch.manual_seed(0)  # every learner must build the same model (the syncer checks its signature)
    return nn.Sequential(nn.Embedding(64, 32), nn.Flatten(), nn.Linear(32 * 8, 64), nn.GELU(), nn.Linear(64, 64))


def main(syncer: str, learner_id: str, steps: int = 200) -> Learner:
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    learner = Learner(model, GrpcTransport(syncer), learner_id)  # joins; the model now holds the global values
    data = torch.Generator().manual_seed(hash(learner_id) % 2**31)
    for _ in range(steps):
        x = torch.randint(0, 64, (16, 8), generator=data)
        y = x.sum(dim=1) % 64  # a toy task: predict the sum of the tokens modulo 64
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        learner.step(tokens=x.numel(), loss=loss.item())  # pushes, applies merged fragments, heartbeats
        if learner.should_stop:
            break
    learner.finish()  # pushes what is left and leaves the run
    return learner


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--syncer", default="127.0.0.1:50051")
    p.add_argument("--id", default="alice")
    p.add_argument("--steps", type=int, default=200)
    a = p.parse_args()
    done = main(a.syncer, a.id, a.steps)
    print(f"{a.id}: {done.step_count} steps, {done.pushes} pushes, {done.applied} merged fragments applied")
