"""Decoupled DiLoCo's quality against data-parallel at a token budget that means something: dp and M learners on one
GPU, the learners' rounds on the device (device_rounds.py), so that 20 tokens per parameter of a ~5M model fits in
the minutes a GPU is lent.

    python3 -m benchmarks.gpu.quality --corpus runs/corpus --out OUT --budget 480            # 5m, 20 tokens/param
    python3 -m benchmarks.gpu.quality --corpus runs/corpus --out OUT --model 36m --tokens-per-param 2 \\
        --arms default --learners 2,4
    python3 -m benchmarks.gpu.quality --corpus runs/corpus --out OUT --mixed --arms default --learners 3
    python3 -m benchmarks.gpu.quality --smoke --out OUT                                     # CPU, seconds

Writes OUT/gpu_quality.json (every curve, the settings, the commit, the machine) and OUT/gpu_quality.md (final
held-out loss against dp per arm, seed and M). Arms: the decoupled defaults, the paper preset and its stable form
(`--momentum-every 2`). `--mixed`: M learners of bf16, fp32 and bf16 at half speed (cycling) against M equal bf16
ones at the same tokens. Runs share `--budget` seconds; one that runs out stops and says so.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from diloco.train.train_config import ModelConfig
from diloco.train.data import eval_batches
from diloco.train.model import build_model
from benchmarks.gpu.runs import quality_rows, run_device, run_dp
from benchmarks.gpu.setup import Setup, load_corpus, smoke_corpus, train_config
from benchmarks.provenance import commit, stamped

ARMS = {"default": ("default", {}), "paper": ("paper", {}), "paper-dn2": ("paper", dict(momentum_every=2))}
"""Name: (preset, syncer settings over it)."""


def model_config(name: str, vocab: int, **options) -> ModelConfig:
    """5m: 6 layers, 256 wide, sequences of 256; 36m: the 35m model of scale.py; smoke: CPU scale. `options`:
    ModelConfig's qk_norm and z_loss."""
    shapes = {"smoke": dict(seq_len=64, d_model=64, n_layers=2, n_heads=2),
              "5m": dict(seq_len=256, d_model=256, n_layers=6, n_heads=4),
              "36m": dict(seq_len=512, d_model=512, n_layers=6, n_heads=8)}
    return ModelConfig(vocab_size=vocab, **shapes[name], **options)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", type=Path, help="a folder written by benchmarks/gpu/corpus.py (--smoke: optional)")
    p.add_argument("--out", type=Path, default=Path("runs/gpu_quality"), help="output folder (runs/gpu_quality)")
    p.add_argument("--device", help="cuda (default when there is one) or cpu")
    p.add_argument("--smoke", action="store_true", help="the same code at CPU scale, in seconds")
    p.add_argument("--model", choices=("5m", "36m"), default="5m", help="model size (5m)")
    p.add_argument("--tokens-per-param", type=float, default=20.0, help="token budget per parameter (20)")
    p.add_argument("--learners", default="2,4", help="comma-separated M (2,4)")
    p.add_argument("--arms", default="default,paper,paper-dn2", help=f"comma-separated: {', '.join(ARMS)}")
    p.add_argument("--mixed", action="store_true", help="mixed hardware (bf16, fp32, half speed) against equal")
    p.add_argument("--seeds", default="0", help="comma-separated seeds (0)")
    p.add_argument("--batch", type=int, default=64, help="dp's global batch in sequences (64)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW lr of dp and every learner (0.003)")
    p.add_argument("--warmup", type=int, default=30, help="lr warm-up steps (30)")
    p.add_argument("--evals", type=int, default=10, help="evaluations per run (10)")
    p.add_argument("--compile", action="store_true", help="torch.compile every replica")
    p.add_argument("--qk-norm", action="store_true", help="LayerNorm on queries and keys (the model's qk_norm)")
    p.add_argument("--z-loss", type=float, default=0.0, help="z-loss weight in the training loss (0: off; 1e-4)")
    p.add_argument("--budget", type=float, help="seconds for every run together (480; --smoke: 120)")
    args = p.parse_args(argv)
    unknown = set(args.arms.split(",")) - set(ARMS)
    if unknown:
        p.error(f"unknown arm {', '.join(sorted(unknown))}; choose from {', '.join(ARMS)}")
    try:
        args.learner_counts = [int(m) for m in args.learners.split(",")]
        args.seed_list = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        p.error("--learners and --seeds take comma-separated whole numbers")
    if any(m < 1 for m in args.learner_counts) or args.tokens_per_param <= 0 or args.batch < 1:
        p.error("--learners, --tokens-per-param and --batch must be positive")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: this machine has no CUDA device (torch sees none); use --smoke on a CPU")
    if not args.smoke and args.corpus is None:
        p.error("--corpus is required (build it with `python -m benchmarks.gpu.corpus runs/corpus`)")
    if args.smoke:
        args.batch, args.evals = min(args.batch, 16), min(args.evals, 4)
    if args.budget is None:
        args.budget = 120.0 if args.smoke else 480.0
    return args


def plan(args) -> list[tuple]:
    """(name, M, preset, settings, dtypes, speeds) of every decoupled run of one seed."""
    runs = []
    for m in args.learner_counts:
        for arm in args.arms.split(","):
            preset, settings = ARMS[arm]
            runs.append((f"{arm}-M{m}", m, preset, settings, None, None))
            if args.mixed:
                cycle = [(torch.bfloat16, 1.0), (torch.float32, 1.0), (torch.bfloat16, 0.5)]
                mix = [cycle[i % 3] for i in range(m)]
                runs.append((f"{arm}-M{m}-mixed", m, preset, settings, [d for d, _ in mix], [s for _, s in mix]))
    return runs


def table(report: dict) -> str:
    lines = [f"# Quality against data-parallel ({report['device']}, {report['model']['parameters']:,} parameters, "
             f"{report['tokens']:,} tokens, {report['settings']['tokens_per_param']} per parameter)", "",
             "| seed | run | final loss | − dp's | tokens/s (training) | stopped |", "|---|---|---|---|---|---|"]
    for seed in report["seeds"]:
        lines.append(f"| {seed['seed']} | dp | {seed['dp']['final_loss']:.4f} | | "
                     f"{seed['dp']['tokens_per_second'] or 0:,.0f} | {seed['dp']['stopped'] or ''} |")
        for row, run in zip(seed["rows"], seed["runs"]):
            lines.append(f"| {seed['seed']} | {row['run']} | {row['final_loss']:.4f} | {row['gap_nats']:+.4f} | "
                         f"{run.get('training_tokens_per_second') or 0:,.0f} | {row['stopped'] or ''} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    end = started + args.budget

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {msg}", flush=True)

    device = torch.device(args.device)
    torch.set_float32_matmul_precision("high")
    if device.type == "cpu" and args.smoke:
        torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    corpus_dir = args.corpus or smoke_corpus(args.out, log)
    train_tokens, heldout_tokens, vocab = load_corpus(corpus_dir, log)
    model = model_config("smoke" if args.smoke else args.model, vocab, qk_norm=args.qk_norm, z_loss=args.z_loss)
    parameters = sum(p.numel() for p in build_model(model, 0).parameters())
    unit = args.batch * model.seq_len
    tokens = max(unit * args.evals, int(args.tokens_per_param * parameters) // unit * unit)
    if args.smoke:
        tokens = min(tokens, unit * 12)
    runs = plan(args)
    log(f"{parameters:,} parameters, {tokens:,} tokens per run ({tokens // unit} dp steps; corpus "
        f"{len(train_tokens):,} training tokens, {tokens / len(train_tokens):.1f} passes); "
        f"{len(args.seed_list)} × (dp + {len(runs)} runs) in {args.budget:.0f} s")
    report = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  torch=torch.__version__, machine=platform.platform(), commit=commit(),
                  command=" ".join(["python3 -m benchmarks.gpu.quality", *(argv if argv is not None else sys.argv[1:])]),
                  settings={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                  model=dict(vars(model), parameters=parameters), tokens=tokens,
                  corpus=dict(path=str(corpus_dir), train_tokens=len(train_tokens), vocab=vocab), seeds=[])
    left = len(args.seed_list) * (len(runs) + 1)
    for seed in args.seed_list:
        train = train_config(SimpleNamespace(batch=args.batch, lr=args.lr, warmup=args.warmup, seed=seed,
                                             eval_batches=8 if args.smoke else 16,
                                             eval_batch_size=8 if args.smoke else 32), model)
        setup = Setup(device, model, train, args.batch, tokens=tokens, evals=args.evals, train_tokens=train_tokens,
                      heldout_tokens=heldout_tokens)
        setup.eval_data = [(x.to(device), y.to(device)) for x, y in
                           eval_batches(heldout_tokens, model.seq_len, train.eval_batches, train.eval_batch_size)]
        dp = run_dp(setup, time.monotonic() + (end - time.monotonic()) / left, log=log)
        left -= 1
        outcomes = []
        for name, m, preset, settings, dtypes, speeds in runs:
            outcomes.append(run_device(setup, name, m, preset, time.monotonic() + (end - time.monotonic()) / left,
                                       dtypes=dtypes, speeds=speeds, log=log, overrides=settings,
                                       compile_model=args.compile))
            left -= 1
            log(f"{name}: {outcomes[-1].final:.4f} ({outcomes[-1].final - dp.final:+.4f} against dp)")
        report["seeds"].append(dict(seed=seed, dp=dp.to_json(), runs=[o.to_json() for o in outcomes],
                                    rows=quality_rows(dp, outcomes)))
        (args.out / "gpu_quality.json").write_text(json.dumps(stamped(report, args), indent=1))  # after every seed
    (args.out / "gpu_quality.md").write_text(table(report))
    log(f"wrote {args.out / 'gpu_quality.json'} and {args.out / 'gpu_quality.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
