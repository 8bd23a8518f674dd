"""How far an entropy coder could shrink the wire payloads: real outer gradients, encoded as they are pushed.

    python -m benchmarks.links.payload_entropy --model tiny --warmup 200 --cycles 3

Trains the built-in model with AdamW on the built-in corpus (one learner, batch and learning rate from the
defaults), then takes Δ over --steps steps (H, one push cycle) --cycles times, and encodes each Δ in int4 and int8
as a learner and the syncer do. Reported per codec: the payload's bytes, the order-0 entropy of its quantised
values (what a coder of independent symbols could reach, the block scales counted in full), and what zlib at
level 6 gives (it also finds the redundancy of the scales' bytes). A coder is worth its CPU and a protocol field
only if the saving is large.
"""

from __future__ import annotations

import argparse
import json
import statistics
import zlib
from dataclasses import replace

import numpy as np
import torch

from diloco.algorithm import codec
from diloco.run.local import TINY
from diloco.train.train_config import TrainConfig, make_inner_optimizer
from diloco.train.data import Corpus, ShardSampler
from diloco.train.model import build_model
from benchmarks.provenance import stamped


def symbols(payload: codec.Encoded) -> tuple[np.ndarray, int]:
    """The quantised values of a block codec's payload, and the bytes of its scales."""
    blocks = -(-payload.numel // codec.BLOCK)
    body = np.frombuffer(payload.data, dtype=np.uint8, offset=codec.SCALE_BYTES * blocks)
    if payload.codec == "int4":
        body = np.stack([body & 0x0F, body >> 4], axis=1).reshape(-1)
    return body[: payload.numel], codec.SCALE_BYTES * blocks


def entropy_bytes(payload: codec.Encoded) -> float:
    values, scale_bytes = symbols(payload)
    counts = np.bincount(values, minlength=256).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum()) * values.size / 8 + scale_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("small", "tiny"), default="tiny")
    p.add_argument("--warmup", type=int, default=200, help="steps trained before the first Δ")
    p.add_argument("--steps", type=int, default=24, help="steps per Δ (H)")
    p.add_argument("--cycles", type=int, default=3)
    p.add_argument("--json", type=str)
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = TrainConfig()
    if args.model == "tiny":
        cfg = replace(cfg, model=TINY)
    corpus = Corpus.from_config(cfg)
    model = build_model(cfg.model, cfg.seed)
    optimizer = make_inner_optimizer(model, cfg)
    sampler = ShardSampler(corpus.train, 0, 1, cfg.model.seq_len, cfg.batch_size, cfg.seed)

    def train(steps: int) -> None:
        for _ in range(steps):
            x, y = sampler.next_batch()
            _, loss = model(x, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    def flat() -> torch.Tensor:
        return torch.cat([q.detach().reshape(-1) for q in model.parameters()]).clone()

    train(args.warmup)
    rows: dict[str, list[dict]] = {"int4": [], "int8": []}
    for _ in range(args.cycles):
        base = flat()
        train(args.steps)
        delta = base - flat()
        for name in rows:
            payload = codec.encode(delta, name)
            size = len(payload.data)
            rows[name].append({"bytes": size, "entropy": entropy_bytes(payload) / size,
                               "zlib6": len(zlib.compress(bytes(payload.data), 6)) / size})
    result = {name: {"bytes": r[0]["bytes"], "entropy_ratio_median": statistics.median(x["entropy"] for x in r),
                     "zlib6_ratio_median": statistics.median(x["zlib6"] for x in r), "cycles": r}
              for name, r in rows.items()}
    for name, r in result.items():
        print(f"{name}: {r['bytes']:,} bytes; order-0 entropy {r['entropy_ratio_median']:.3f} of that, "
              f"zlib {r['zlib6_ratio_median']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(stamped({"model": args.model, "warmup": args.warmup, "steps": args.steps, **result}, args), f, indent=1)


if __name__ == "__main__":
    main()
