"""Why a short mixed-hardware run's global loss can stand still: scale.py's mixed run, traced, at CPU scale.

Three learners in one process (bf16, fp32, and bf16 at half speed) against the in-process syncer, as scale.py's
mixed part runs them, on its --smoke model and corpus. At every evaluation of the global model it prints the
held-out loss, the rounds closed so far, and the fragments whose round holds a contribution while it waits for more.
A round stays open for a live learner whose push of the fragment is predicted within `grace_expect_steps` of its
step times (the decoupled default: H). Compare the default with the window off:

    python -m benchmarks.gpu.mixed_rounds                          # grace_expect_steps = H, the decoupled default
    python -m benchmarks.gpu.mixed_rounds --grace-expect-steps 0   # rounds close on quorum and the paper's window alone

The default --tokens gives each full-speed learner about as many steps (48) as the mixed run on the H200 had.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from diloco.train.data import eval_batches
from benchmarks.gpu.runs import run_decoupled
from benchmarks.gpu.setup import Setup, load_corpus, model_configs, smoke_corpus, train_config

LEARNER_BATCH = 64 // 3  # scale.py's global batch of 64 sequences over three learners


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=118 * LEARNER_BATCH * 64,
                   help="tokens of the run, all learners together (default: 118 learner steps)")
    p.add_argument("--evals", type=int, default=20,
                   help="evaluations of the global model, the last after every learner's finish")
    p.add_argument("--grace-expect-steps", type=float, default=None,
                   help="the syncer's grace_expect_steps (default: the decoupled mode's, H)")
    p.add_argument("--out", type=Path, default=Path("runs/mixed_rounds"), help="where the small corpus is built")
    args = p.parse_args(argv)
    if args.tokens <= 0 or args.evals <= 0:
        p.error("--tokens and --evals must be positive")
    if args.grace_expect_steps is not None and args.grace_expect_steps < 0:
        p.error(f"--grace-expect-steps must be non-negative, got {args.grace_expect_steps}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    train_tokens, heldout_tokens, vocab = load_corpus(smoke_corpus(args.out, print), lambda *_: None)
    model = model_configs(vocab, smoke=True)["35m"]
    train = train_config(SimpleNamespace(batch=64, lr=3e-3, warmup=30, seed=0, eval_batches=4, eval_batch_size=8),
                         model)
    setup = Setup(torch.device("cpu"), model, train, 64, tokens=args.tokens, evals=args.evals,
                  train_tokens=train_tokens, heldout_tokens=heldout_tokens)
    setup.eval_data = list(eval_batches(heldout_tokens, model.seq_len, 4, 8))
    overrides = {} if args.grace_expect_steps is None else {"grace_expect_steps": args.grace_expect_steps}

    print("| tokens | held-out loss | rounds | fragments waiting |")
    print("|---|---|---|---|")

    def trace(tokens: int, loss: float, status: dict) -> None:
        waiting = sum(1 for n in status["pending"] if n)
        print(f"| {tokens:,} | {loss:.4f} | {status['rounds']} | {waiting} of {len(status['pending'])} |", flush=True)

    out = run_decoupled(setup, "mixed", 3, "default", time.monotonic() + 3600,
                        dtypes=[torch.bfloat16, torch.float32, torch.bfloat16], speeds=[1.0, 1.0, 0.5],
                        log=lambda *_: None, overrides=overrides, trace=trace)
    losses = [loss for _, loss in out.curve]
    unchanged = sum(1 for a, b in zip(losses, losses[1:]) if a == b)
    print(f"grace_expect_steps {out.extra['sync']['grace_expect_steps']:g}: final {out.final:.4f}, "
          f"{out.extra['rounds']} rounds, steps {out.extra['steps']}, "
          f"{unchanged} of {len(losses) - 1} evaluations equal to the one before")
    return 0


if __name__ == "__main__":
    sys.exit(main())
