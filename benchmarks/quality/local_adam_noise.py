"""Where local training loses to data-parallel, in one process and without a syncer: M learners with AdamW on
their own quarter of dp's batch, their parameters averaged every H steps, against one AdamW on the whole batch.

    python -m benchmarks.quality.local_adam_noise --seeds 0,1,2 --json runs/local-adam.json

Variants, all with the same data (learner i reads shard i of M, as `diloco run` does; dp's step is the M learners'
batches together) and the built-in trainer's schedule, clipping and weight decay:

- dp: one model, the M batches' gradients averaged, then AdamW.
- local: M models, each AdamW on its own gradient (its own second moment v), averaged every H steps.
- local-shared-v: the same, except every learner's v follows the averaged gradient, as dp's does (an oracle: it
  needs every step's gradients from every learner, which a real run does not have). m stays each learner's own.
- local-H1: own v, parameters averaged after every step.

If local-shared-v closes most of the gap and local-H1 does not, what local training loses is the second moment's
noise on a quarter batch, not the drift between syncs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

from diloco.run.local import TINY
from diloco.train.train_config import TrainConfig, lr_at
from diloco.train.data import Corpus, ShardSampler, eval_batches, evaluate
from diloco.train.model import build_model
from benchmarks.provenance import stamped


class ManualAdamW:
    """AdamW over a list of models' parameters, one (m, v) per model, so that v may follow another gradient."""

    def __init__(self, models, cfg: TrainConfig, lr_scale: float = 1.0):
        self.cfg, self.lr_scale = cfg, lr_scale
        self.params = [[p for p in m.parameters() if p.requires_grad] for m in models]
        self.m = [[torch.zeros_like(p) for p in ps] for ps in self.params]
        self.v = [[torch.zeros_like(p) for p in ps] for ps in self.params]
        self.t = 0

    @torch.no_grad()
    def step(self, grads, v_grads, lr: float) -> None:
        """grads[i][k]: model i's gradient of parameter k; v_grads the same for its second moment."""
        b1, b2 = self.cfg.betas
        lr *= self.lr_scale
        self.t += 1
        c1, c2 = 1 - b1 ** self.t, 1 - b2 ** self.t
        for i, ps in enumerate(self.params):
            for k, p in enumerate(ps):
                self.m[i][k].mul_(b1).add_(grads[i][k], alpha=1 - b1)
                self.v[i][k].mul_(b2).addcmul_(v_grads[i][k], v_grads[i][k], value=1 - b2)
                if p.dim() >= 2:
                    p.mul_(1 - lr * self.cfg.weight_decay)
                p.addcdiv_(self.m[i][k] / c1, (self.v[i][k] / c2).sqrt().add_(1e-8), value=-lr)


def clipped_grads(model, x, y, clip: float) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    return [p.grad.detach().clone() for p in model.parameters() if p.requires_grad]


@torch.no_grad()
def average_into(models) -> None:
    for ps in zip(*(m.parameters() for m in models)):
        mean = torch.stack([p for p in ps]).mean(0)
        for p in ps:
            p.copy_(mean)


def run(variant: str, cfg: TrainConfig, learners: int, tokens: int, sync_every: int,
        learner_cfg: TrainConfig | None = None, lr_scale: float = 1.0) -> float:
    """learner_cfg / lr_scale: the local variants' AdamW settings where they differ from dp's."""
    corpus = Corpus.from_config(cfg)
    samplers = [ShardSampler(corpus.train, i, learners, cfg.model.seq_len, cfg.batch_size, cfg.seed)
                for i in range(learners)]
    steps = tokens // (learners * cfg.tokens_per_step())
    models = [build_model(cfg.model, cfg.seed) for _ in range(1 if variant == "dp" else learners)]
    optimizer = ManualAdamW(models, cfg) if variant == "dp" else \
        ManualAdamW(models, learner_cfg or cfg, lr_scale)
    h = 1 if variant == "local-H1" else sync_every
    for step in range(steps):
        lr = lr_at(step, cfg, step / steps)  # one schedule for every variant (--decay-fraction sets it)
        batches = [s.next_batch() for s in samplers]
        if variant == "dp":  # DDP: the workers' gradients averaged, then clipped
            models[0].zero_grad(set_to_none=True)
            for x, y in batches:
                _, loss = models[0](x, y)
                (loss / learners).backward()
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(models[0].parameters(), cfg.grad_clip)
            grads = [[p.grad.detach().clone() for p in models[0].parameters() if p.requires_grad]]
            optimizer.step(grads, grads, lr)
            continue
        grads = [clipped_grads(m, x, y, cfg.grad_clip) for m, (x, y) in zip(models, batches)]
        v_grads = grads
        if variant == "local-shared-v":
            mean = [torch.stack(gs).mean(0) for gs in zip(*grads)]
            v_grads = [mean] * learners
        optimizer.step(grads, v_grads, lr)
        if (step + 1) % h == 0 or step == steps - 1:
            average_into(models)
    heldout = eval_batches(corpus.heldout, cfg.model.seq_len, cfg.eval_batches, cfg.eval_batch_size)
    return evaluate(models[0], heldout)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0")
    p.add_argument("--learners", type=int, default=4)
    p.add_argument("--tokens", type=int, default=1_600_000)
    p.add_argument("--sync-every", type=int, default=24)
    p.add_argument("--variants", default="dp,local,local-shared-v,local-H1")
    p.add_argument("--batch-size", type=int, default=TrainConfig.batch_size, help="sequences per learner step")
    p.add_argument("--learner-beta2", type=float, help="the local variants' AdamW beta2 (dp keeps its own)")
    p.add_argument("--learner-lr-scale", type=float, default=1.0, help="the local variants' lr over dp's")
    p.add_argument("--decay-fraction", type=float, default=TrainConfig.decay_fraction,
                   help="share of the run over which every variant's lr decays (dp's too)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    torch.set_num_threads(1)
    results: dict = {"learners": args.learners, "tokens": args.tokens, "sync_every": args.sync_every, "runs": {}}
    seeds = [int(s) for s in args.seeds.split(",")]
    variants = args.variants.split(",")
    for seed in seeds:
        cfg = replace(TrainConfig(model=TINY), seed=seed, batch_size=args.batch_size, decay_fraction=args.decay_fraction)
        learner_cfg = replace(cfg, betas=(cfg.betas[0], args.learner_beta2)) if args.learner_beta2 else cfg
        for variant in variants:
            loss = run(variant, cfg, args.learners, args.tokens, args.sync_every, learner_cfg, args.learner_lr_scale)
            results["runs"][f"{variant}@{seed}"] = loss
            print(f"{variant}@{seed}: {loss:.4f}", file=sys.stderr, flush=True)
            if args.json:
                args.json.write_text(json.dumps(stamped(results, args), indent=1))
    print("| variant | final held-out loss − dp's (seeds " + ", ".join(map(str, seeds)) + ") |\n|---|---|")
    for variant in variants:
        gaps = [results["runs"][f"{variant}@{s}"] - results["runs"][f"dp@{s}"] for s in seeds] if "dp" in variants \
            else [results["runs"][f"{variant}@{s}"] for s in seeds]
        print(f"| {variant} | {statistics.fmean(gaps):+.3f} ({', '.join(f'{g:+.3f}' for g in gaps)}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
