"""A torchrun job as ONE learner of a run: DDP inside the island, DiLoCo between islands.

Every rank builds the model, wraps it in DistributedDataParallel and creates its Learner with the job's process
group; rank 0 talks to the syncer and the other ranks follow it. Start a syncer first:

    diloco syncer --listen 127.0.0.1:50051 --state runs/syncer
    torchrun --nproc-per-node 2 examples/torchrun_ddp.py --syncer 127.0.0.1:50051 --id island-a

gloo on CPU; on GPUs (one per rank) the job uses NCCL and CUDA automatically.
"""

import argparse
import gc
import hashlib
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from diloco import GrpcTransport, Learner


def make_model() -> nn.Module:
    torch.manual_seed(0)  # every learner must build the same model (the syncer checks its signature)
    return nn.Sequential(nn.Embedding(64, 32), nn.Flatten(), nn.Linear(32 * 8, 64), nn.LayerNorm(64), nn.GELU(),
                         nn.Linear(64, 64))


def state_digest(model: nn.Module) -> str:
    """A hash of every parameter's bytes: equal digests mean bit-identical replicas."""
    h = hashlib.sha256()
    for p in model.state_dict().values():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(syncer: str, learner_id: str, steps: int, check: bool = False, summary: str | None = None) -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    model = make_model().to(device)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    transport = GrpcTransport(syncer) if rank == 0 else None  # only rank 0 talks to the syncer
    learner = Learner(ddp, transport, learner_id, process_group=dist.group.WORLD)
    data = torch.Generator().manual_seed(hash((learner_id, rank)) % 2**31)  # each rank reads its own data
    mismatches = 0
    for _ in range(steps):
        x = torch.randint(0, 64, (16, 8), generator=data).to(device)
        loss = nn.functional.cross_entropy(ddp(x), x.sum(dim=1) % 64)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        learner.step(tokens=x.numel(), loss=loss.item())  # every rank, every step
        if check:  # every rank of the island must hold the same values after each step (and so each apply)
            digests = [None] * world
            dist.all_gather_object(digests, state_digest(model))
            mismatches += len(set(digests)) > 1
        if learner.should_stop:
            break
    learner.finish()
    if rank == 0:
        print(f"{learner_id}: {learner.step_count} steps, {learner.pushes} pushes, {learner.applied} applied, "
              f"{mismatches} steps with ranks apart")
        if summary:
            with open(summary, "w") as f:
                json.dump({"steps": learner.step_count, "pushes": learner.pushes, "applied": learner.applied,
                           "tokens": learner.tokens, "mismatches": mismatches, "world": world}, f)
    # nothing that holds the group outlives it (DDP's reducer, the learner), and no rank tears the group down while
    # another still uses it: a rank aborted at exit, rarely, otherwise
    del learner, ddp, optimizer
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    if mismatches:
        raise SystemExit(f"rank {rank}: parameters differed between ranks after {mismatches} steps")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--syncer", default="127.0.0.1:50051")
    p.add_argument("--id", default="island-a")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--check-identical", action="store_true", help="verify after every step that all ranks agree")
    p.add_argument("--summary", help="rank 0 writes its counters here as JSON")
    a = p.parse_args()
    main(a.syncer, a.id, a.steps, a.check_identical, a.summary)
