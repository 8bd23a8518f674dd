"""One learner as a Hugging Face Trainer with DiLoCoCallback (a separate process, so a test can SIGKILL it):
trains the tiny GPT-2 on its shard, saves checkpoints every --save-steps, resumes from the one --resume names,
and writes what its learner did to --summary (under torchrun, one learner of several ranks: --summary.RANK).
With --start-when it waits, imports done, until that file exists."""

import argparse
import hashlib
import json
import os
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from integrations_support import Rows, collate, examples, tiny_gpt2  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from diloco.integrations.transformers import DiLoCoCallback  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--syncer", required=True)
    p.add_argument("--id", required=True)
    p.add_argument("--shard", type=int, default=0)
    p.add_argument("--num-shards", type=int, default=2)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--save-steps", type=int, default=8)
    p.add_argument("--out", required=True)
    p.add_argument("--resume", help="the checkpoint folder to resume from")
    p.add_argument("--summary", required=True)
    p.add_argument("--start-when", help="a file: train once it exists, for as many steps in all as it says, from the "
                                        "checkpoint it names (a standby for a restart, its imports done)")
    a = p.parse_args()
    torch.set_num_threads(1)
    rows = examples(a.shard, a.num_shards, 256)  # the Trainer goes over them as many epochs as max_steps takes
    if a.start_when:
        while not pathlib.Path(a.start_when).exists():
            time.sleep(0.05)
        steps, checkpoint = pathlib.Path(a.start_when).read_text().split()
        a.steps, a.resume = int(steps), checkpoint
    callback = DiLoCoCallback(a.syncer, a.id, connect_timeout=60)
    args = TrainingArguments(output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=8, learning_rate=3e-3,
                             lr_scheduler_type="constant", save_steps=a.save_steps, logging_steps=4, report_to=[],
                             use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, seed=a.shard)
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=Rows(rows), data_collator=collate,
                      callbacks=[callback])
    trainer.train(resume_from_checkpoint=a.resume)
    learner = callback.learner
    rank, ranks = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    summary = pathlib.Path(a.summary if ranks == 1 else f"{a.summary}.{rank}")  # under torchrun: one per rank
    digest = hashlib.sha256(b"".join(t.detach().contiguous().numpy().tobytes()
                                     for t in trainer.model.state_dict().values())).hexdigest()
    summary.write_text(json.dumps({"digest": digest, "ranks": ranks,
        "steps": learner.step_count, "pushes": learner.pushes, "applied": learner.applied, "tokens": learner.tokens,
        "ledger_position": callback.driver.ledger_position,
        "resumed": callback.driver.resumed.to_json() if callback.driver.resumed else None,
        "global_step": trainer.state.global_step}))
    # PyTorch's rule for the end of a script: a gloo group left to interpreter exit can abort it (pytorch#190489)
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
