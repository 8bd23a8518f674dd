"""What the framework integration tests share: a real `diloco syncer` process, a tiny GPT-2 built from code (nothing
downloaded), byte-level examples of the built-in corpus (optionally padded), and the held-out loss."""

from __future__ import annotations

import functools
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import urllib.request

import numpy as np
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
SEQ_LEN = 32
VOCAB = 256  # token ids are UTF-8 bytes
PAD = 0


class SyncerProcess:
    """`python -m diloco syncer` on a free loopback port, its state in `state`; stop() ends it and returns its final
    status (syncer.json). Use as a context manager so that it never outlives the test."""

    def __init__(self, state: pathlib.Path, *args: str, start_timeout: float = 120.0):
        self.state = state
        state.mkdir(parents=True, exist_ok=True)
        self.log = state.parent / f"{state.name}.log"
        with self.log.open("a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "diloco", "--log-level", "INFO", "syncer", "--listen", "127.0.0.1:0", "--http",
                 "127.0.0.1:0", "--state", str(state), *args],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        ready = state / "ready.json"
        deadline = time.monotonic() + start_timeout
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"the syncer did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.05)
        self.ready = json.loads(ready.read_text())
        self.address = f"127.0.0.1:{self.ready['grpc_port']}"

    def status(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ready['http_port']}/status", timeout=10) as r:
            return json.loads(r.read())

    def learner(self, learner_id: str) -> dict:
        return {x["id"]: x for x in self.status()["learners"]}.get(learner_id, {})

    def stop(self, timeout: float = 60.0) -> dict:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"the syncer did not stop on SIGTERM:\n{self.log.read_text()[-3000:]}")
        assert self.proc.returncode == 0, self.log.read_text()[-3000:]
        return json.loads((self.state / "syncer.json").read_text())

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def __enter__(self) -> SyncerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


def tiny_gpt2(seed: int = 0):
    """A 2-layer, 32-wide GPT-2 with a tied head, without dropout (runs are then deterministic)."""
    from transformers import AutoModelForCausalLM, GPT2Config

    torch.manual_seed(seed)  # every learner must build the same model (the syncer checks its signature)
    config = GPT2Config(vocab_size=VOCAB, n_layer=2, n_embd=32, n_head=2, n_positions=SEQ_LEN, bos_token_id=None,
                        eos_token_id=None, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


@functools.cache
def corpus():
    """Four of the built-in corpus's plays (half a megabyte): plenty for these runs, and read in a moment."""
    from diloco.train.data import Corpus, builtin_corpus_files, load_text

    return Corpus.from_text(load_text([str(f) for f in builtin_corpus_files()[:4]]), heldout_fraction=0.05)


def examples(shard: int, num_shards: int, n: int, *, padded: bool = False, seed: int = 0) -> list[dict]:
    """`n` training examples of SEQ_LEN byte tokens from `shard` of the built-in corpus, as a Hugging Face dataset
    row: input_ids, attention_mask and labels (the model shifts them). `padded`: each example keeps a random
    length and is padded at the end (attention_mask 0, labels -100), so padding is there to be left uncounted."""
    from diloco.train.data import ShardSampler

    data = ShardSampler(corpus().train, shard, num_shards, SEQ_LEN, batch_size=1, seed=seed)
    lengths = np.random.default_rng([seed, shard]).integers(SEQ_LEN // 4, SEQ_LEN + 1, n) if padded else [SEQ_LEN] * n
    rows = []
    for length in lengths:
        x, _ = data.next_batch()
        ids = x[0].clone()
        mask = torch.ones(SEQ_LEN, dtype=torch.int64)
        mask[length:] = 0
        ids[length:] = PAD
        labels = ids.masked_fill(mask == 0, -100)
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return rows


class Rows(torch.utils.data.Dataset):
    """A list of examples as a map-style dataset."""

    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


class InOrder(torch.utils.data.IterableDataset):
    """The examples in their order, every epoch (a Trainer does not shuffle an IterableDataset)."""

    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)


def collate(rows: list[dict]) -> dict:
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


@torch.no_grad()
def heldout_loss(model, n_batches: int = 4, batch_size: int = 16) -> float:
    from diloco.train.data import eval_batches

    was = model.training
    model.eval()
    try:
        losses = []
        for x, y in eval_batches(corpus().heldout, SEQ_LEN, n_batches, batch_size):
            logits = model(input_ids=x).logits
            losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).item())
        return sum(losses) / len(losses)
    finally:
        model.train(was)


def final_model(state: pathlib.Path, build=tiny_gpt2):
    """A fresh model (other initial values) with the syncer's final model loaded strictly."""
    from safetensors.torch import load_file

    model = build(seed=1)
    model.load_state_dict(load_file(state / "model.safetensors"), strict=True)
    return model


def lightning_module(model=None, lr: float = 3e-3):
    """The tiny GPT-2 as a LightningModule: the model's own loss, AdamW (fused, as a Trainer makes it)."""
    import lightning.pytorch as pl

    class CausalLM(pl.LightningModule):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=lr, weight_decay=0.0, fused=True)

    return CausalLM(model if model is not None else tiny_gpt2())


def lightning_trainer(out: pathlib.Path, steps: int, callbacks: list, **options):
    import lightning.pytorch as pl

    args = dict(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(out),
                num_sanity_val_steps=0)
    args.update(options)
    return pl.Trainer(callbacks=callbacks, **args)


def loader(rows: list[dict], batch_size: int):
    """The rows in their order, batch after batch (no shuffling: runs compare step by step)."""
    return torch.utils.data.DataLoader(Rows(rows), batch_size=batch_size, shuffle=False, collate_fn=collate)


def final_pushes(tape: pathlib.Path, learner_id: str) -> list[dict]:
    """The merged contributions of `learner_id` that were its last pushes (made as it left), from a syncer's tape."""
    events = [json.loads(line) for line in tape.read_text().splitlines()]
    return [c for e in events if e.get("event") == "round" for c in e["contributors"]
            if c["learner"] == learner_id and c.get("final")]
