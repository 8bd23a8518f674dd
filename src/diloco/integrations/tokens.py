"""How many tokens one micro-batch holds, as a learner counts them for the syncer's token weights and budget.

The rule, for a batch given as a mapping (what a Hugging Face model is called with, or a dict batch):
  1. `attention_mask` present: its sum — the non-padding tokens the model attended to;
  2. else `labels` present: the labels that are not -100 (the ignore index padding gets);
  3. else `input_ids` (or `inputs_embeds`): every position.
A tensor batch counts every element of the tensor; a tuple or list batch counts its first tensor the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

IGNORE_INDEX = -100
"""The label value Hugging Face collators give padding (and torch's cross-entropy ignores)."""


def count_tokens(batch) -> int:
    """The tokens of one micro-batch (see the module's rule); 0 when it holds nothing the rule recognises."""
    if isinstance(batch, torch.Tensor):
        return batch.numel()
    if isinstance(batch, Mapping):
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            return int(mask.sum().item())
        labels = batch.get("labels")
        if isinstance(labels, torch.Tensor):
            return int((labels != IGNORE_INDEX).sum().item())
        ids = batch.get("input_ids")
        if isinstance(ids, torch.Tensor):
            return ids.numel()
        embeds = batch.get("inputs_embeds")
        if isinstance(embeds, torch.Tensor):
            return embeds.shape[:-1].numel()
        return 0
    if isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)) and batch:
        return count_tokens(batch[0])
    return 0
