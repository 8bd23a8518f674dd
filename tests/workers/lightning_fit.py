"""One learner as a Lightning Trainer with DiLoCoCallback (a separate process, so a test can SIGKILL it): trains the
tiny GPT-2 on its shard, checkpoints every --save-steps into --out, resumes from the checkpoint --resume names, and
writes what its learner did to --summary. With --start-when it waits, imports done, until that file exists; the
file gives the steps to train in all and the checkpoint to resume from."""

import argparse
import hashlib
import json
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from integrations_support import examples, lightning_module, lightning_trainer, loader  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from diloco.integrations.lightning import DiLoCoCallback  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--syncer", required=True)
    p.add_argument("--id", required=True)
    p.add_argument("--shard", type=int, default=0)
    p.add_argument("--num-shards", type=int, default=2)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--save-steps", type=int, default=8)
    p.add_argument("--out", required=True)
    p.add_argument("--resume", help="the checkpoint file to resume from")
    p.add_argument("--summary", required=True)
    p.add_argument("--start-when")
    p.add_argument("--devices", type=int, default=1, help="ranks of a DDP strategy (one learner, an island)")
    a = p.parse_args()
    torch.set_num_threads(1)
    data = loader(examples(a.shard, a.num_shards, 256), batch_size=8)
    if a.start_when:
        while not pathlib.Path(a.start_when).exists():
            time.sleep(0.05)
        steps, checkpoint = pathlib.Path(a.start_when).read_text().split()
        a.steps, a.resume = int(steps), checkpoint
    callback = DiLoCoCallback(a.syncer, a.id, connect_timeout=60)
    saves = ModelCheckpoint(dirpath=a.out, filename="{step}", every_n_train_steps=a.save_steps, save_top_k=-1)
    ddp = dict(devices=a.devices, strategy="ddp") if a.devices > 1 else {}
    trainer = lightning_trainer(pathlib.Path(a.out), a.steps, [callback, saves], enable_checkpointing=True, **ddp)
    trainer.fit(lightning_module(), data, ckpt_path=a.resume)
    learner = callback.learner
    summary = pathlib.Path(a.summary if a.devices == 1 else f"{a.summary}.{trainer.global_rank}")
    digest = hashlib.sha256(b"".join(t.detach().contiguous().numpy().tobytes()
                                     for t in trainer.lightning_module.state_dict().values())).hexdigest()
    summary.write_text(json.dumps({"digest": digest, "ranks": trainer.world_size,
        "steps": learner.step_count, "pushes": learner.pushes, "applied": learner.applied, "tokens": learner.tokens,
        "ledger_position": callback.driver.ledger_position,
        "resumed": callback.driver.resumed.to_json() if callback.driver.resumed else None,
        "global_step": trainer.global_step}))


if __name__ == "__main__":
    main()
