"""A learner that is itself a torch.distributed job (an "island": DDP or FSDP2 ranks started by torchrun).

Only the island's leader (rank 0 of its group) talks to the syncer. Each step the leader tells the other ranks
what it decided — which fragments to push, which merged fragments to apply, whether to stop — and the new
values of applied fragments reach every rank, so the ranks stay bit-identical (DDP) or keep their shards of the
same values (FSDP2). Decisions travel on a CPU (gloo) group of their own, so a CUDA job never waits for a
device-to-host copy to learn them; tensors travel on the job's own group (NCCL on GPUs).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class Island:
    """The ranks of one learner. Every rank must make the same calls in the same order (they are collectives)."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        if not dist.is_initialized():
            raise ValueError("process_group was given but torch.distributed is not initialised: call "
                             "torch.distributed.init_process_group() first (torchrun sets up its environment)")
        self.group = group or dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self.leader_rank = dist.get_global_rank(self.group, 0)
        backend = dist.get_backend(self.group)
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        # decisions are small Python objects: a gloo group keeps them off the GPU stream
        self.control = self.group if backend == "gloo" else dist.new_group(dist.get_process_group_ranks(self.group),
                                                                            backend="gloo")

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def share(self, value=None):
        """The leader's `value` (any picklable object) on every rank."""
        box = [value if self.leader else None]
        dist.broadcast_object_list(box, src=self.leader_rank, group=self.control)
        return box[0]

    def reduce_step(self, tokens: int, loss: float | None) -> tuple[int, float | None]:
        """The island's tokens this step (summed over ranks) and its mean loss (over the ranks that gave one)."""
        t = torch.tensor([float(tokens), loss if loss is not None else 0.0, 1.0 if loss is not None else 0.0],
                         dtype=torch.float64)
        dist.all_reduce(t, group=self.control)
        return int(t[0].item()), (t[1].item() / t[2].item() if t[2].item() else None)

    def broadcast(self, flat: torch.Tensor | None, numel: int) -> torch.Tensor:
        """The leader's flat fp32 vector on every rank (on the job's device)."""
        if self.leader:
            out = flat.to(self.device, torch.float32)
        else:
            out = torch.empty(numel, dtype=torch.float32, device=self.device)
        dist.broadcast(out, src=self.leader_rank, group=self.group)
        return out

    def any(self, flag: bool) -> bool:
        """Whether any rank's flag is set (e.g. a signal to leave that reached some ranks first)."""
        t = torch.tensor([1.0 if flag else 0.0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control)
        return bool(t.item())

    def barrier(self) -> None:
        dist.barrier(group=self.control)
