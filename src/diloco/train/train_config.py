"""Configuration of the built-in model and its inner training, plus the inner optimizer and lr schedule."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class ModelConfig:
    """Shape of the small decoder-only transformer in `diloco.train.model`."""

    vocab_size: int = 256
    """Number of token ids; 256 for the byte-level tokenizer."""

    seq_len: int = 128
    """Context length in tokens: the longest sequence the model sees, and the length of training sequences."""

    d_model: int = 128
    """Width of the residual stream (embedding size)."""

    n_layers: int = 4
    """Number of transformer blocks."""

    n_heads: int = 4
    """Attention heads per block; must divide d_model."""

    mlp_ratio: int = 4
    """Hidden width of each block's MLP as a multiple of d_model."""

    tie_embeddings: bool = True
    """Share one matrix between the token embedding and the output head (fewer parameters, one fewer tensor)."""

    qk_norm: bool = False
    """LayerNorm on each head's queries and keys before attention: keeps attention logits from growing at high
    learning rates (as in the scaling-law studies of DiLoCo). Adds two small tensors per block."""

    z_loss: float = 0.0
    """Weight of the z-loss, mean(logsumexp(logits)²), added to the training loss (not to evaluation): keeps the
    output logits' normaliser near 1. 0 turns it off; the scaling-law studies of DiLoCo use 1e-4."""


@dataclass
class TrainConfig:
    """Inner training of one learner: data, batch, AdamW and evaluation settings."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Shape of the model every learner trains."""

    batch_size: int = 16
    """Sequences per inner step per learner."""

    lr: float = 3e-3
    """Peak AdamW learning rate, reached after `warmup_steps`; held until the decay at the end of the budget."""

    weight_decay: float = 0.1
    """AdamW weight decay, applied only to matrices (parameters with two or more dimensions)."""

    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW (beta1, beta2)."""

    warmup_steps: int = 20
    """Inner steps over which the learning rate rises linearly from lr/warmup_steps to lr."""

    decay_fraction: float = 0.2
    """Final share of the run's budget over which the learning rate falls linearly to `min_lr_ratio`·lr
    (warmup–stable–decay). Applies only when the budget is known (steps, tokens or duration); 0 disables it."""

    min_lr_ratio: float = 0.1
    """Learning rate at the very end of the budget, as a fraction of `lr`."""

    grad_clip: float = 1.0
    """Clip the global gradient norm to this value before each inner step; 0 disables clipping."""

    heldout_fraction: float = 0.05
    """Fraction of the corpus set aside for evaluation; no learner ever trains on it."""

    eval_batches: int = 8
    """Number of fixed held-out batches that one evaluation averages over."""

    eval_batch_size: int = 16
    """Sequences per evaluation batch."""

    corpus: list[str] = field(default_factory=list)
    """Paths of UTF-8 text files, or directories read recursively for *.txt and *.md; empty = built-in Shakespeare."""

    seed: int = 0
    """Seed for model initialisation and data order; every learner of a run must use the same one."""

    def tokens_per_step(self) -> int:
        """Tokens one learner consumes in one inner step."""
        return self.batch_size * self.model.seq_len


def make_inner_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only; biases and LayerNorm gains are not decayed."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr_at(0, cfg), betas=cfg.betas)


def lr_at(step: int, cfg: TrainConfig, progress: float | None = None) -> float:
    """Learning rate for inner step `step` (0 = the first step) when `progress` of the run's budget is spent.

    Linear warmup over the learner's own first steps, constant, then a linear decay over the last
    `decay_fraction` of the budget. The decay follows the run's progress, not the learner's step count, so a
    learner that joins late decays together with the others; with no known budget (`progress` None) the rate
    stays constant after warmup.
    """
    lr = cfg.lr * (step + 1) / cfg.warmup_steps if step < cfg.warmup_steps else cfg.lr
    if progress is None or cfg.decay_fraction <= 0:
        return lr
    into_decay = (progress - (1 - cfg.decay_fraction)) / cfg.decay_fraction
    return lr * (1 - min(max(into_decay, 0.0), 1.0) * (1 - cfg.min_lr_ratio))
