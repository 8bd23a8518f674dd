"""One FSDP2-sharded learner of 2 CPU ranks (gloo), started by tests/e2e/test_islands_integ.py under torchrun.

It joins a run whose global model another learner set, checks that every rank's shards hold exactly those values,
trains, and writes what it saw to argv[2] (rank 0)."""

import gc
import json
import sys

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from diloco import GrpcTransport, Learner


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(64, 32), nn.Flatten(), nn.Linear(32 * 8, 64), nn.GELU(), nn.Linear(64, 64))


def main(address: str, out: str, expected: str, steps: int = 24) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = make_model(seed=100 + rank)  # different from the run's global model, and from rank to rank
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    learner = Learner(model, GrpcTransport(address) if rank == 0 else None, "fsdp", process_group=dist.group.WORLD)
    reference = load_file(expected)  # the global model at join, saved by the test
    joined_exactly = all(torch.equal(t.full_tensor() if hasattr(t, "full_tensor") else t, reference[name])
                         for name, t in model.state_dict().items())
    data = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x = torch.randint(0, 64, (16, 8), generator=data)
        loss = nn.functional.cross_entropy(model(x), x.sum(1) % 64)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        learner.step(x.numel(), loss=loss.item())
    learner.finish()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"joined_exactly": joined_exactly, "pushes": learner.pushes, "applied": learner.applied,
                       "tokens": learner.tokens}, f)
    # freed only at interpreter exit, the FSDP2 model and its optimizer took gloo down with them in about one run
    # of five ("terminate called without an active exception", after the result was written); freed here, none of
    # ten did (docs/operations.md, Troubleshooting)
    del learner, optimizer, model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
