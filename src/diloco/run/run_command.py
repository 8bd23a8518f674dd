"""`diloco run`: a syncer and N learners (or N data-parallel workers) on this machine, then a report."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_network_options(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    n = p.add_argument_group("network (docs/architecture.md, Shaped links)")
    n.add_argument("--link", metavar="RATE",
                   help="give each learner (dp: each worker) its own network namespace behind a link shaped to RATE "
                        "each way with tc, e.g. 5mbit, 100mbit, 500kbit; none: loopback (default). Needs root")
    n.add_argument("--link-latency-ms", type=float, metavar="MS",
                   help="add MS of one-way delay to each learner's connections to the syncer, through a proxy "
                        "(diloco proxy); not with --mode dp, whose gloo traffic cannot take a proxy")
    return n


def register(sub, add_sync_options, add_train_options) -> None:
    from diloco.options import add_config_options, address

    p = sub.add_parser(
        "run", help="train on this machine: a syncer and N learner processes (the main job)",
        description="Start a syncer and N learners on this machine, train the built-in transformer on a real "
                    "corpus with live progress, then print a summary and write a run directory.",
    )
    b = p.add_argument_group("budget (default: --duration 120)")
    b.add_argument("--steps", type=int, help="inner steps per learner")
    b.add_argument("--tokens", type=int,
                   help="tokens trained in total over all learners (learners hear of the end from the syncer, so "
                        "they may train a few steps more; `diloco compare` gives every mode the same whole steps)")
    b.add_argument("--duration", type=float, help="seconds of training")
    add_train_options(p)
    r = p.add_argument_group("learners and processes")
    r.add_argument("--learners", "-M", type=int, default=4, help="learner processes (4)")
    r.add_argument("--syncer-shards", type=int, default=1, metavar="N",
                   help="run N syncer processes, each serving every N-th fragment (1)")
    r.add_argument("--ranks-per-learner", type=int, default=1, metavar="N",
                   help="start each learner as a torchrun job of N ranks (DDP over gloo; 1: one process each)")
    r.add_argument("--speeds", help="per-learner speed factors, e.g. 1,1,0.5,0.25 (slower = longer steps)")
    r.add_argument("--pace", metavar="SECONDS|auto|off",
                   help="pad every step to SECONDS / speed so each learner's capacity is fixed and goodput ≤ 1 "
                        "(auto: measured on this machine; default: auto with --chaos, off otherwise)")
    r.add_argument("--initial-model", choices=("upload", "file"), default="upload",
                   help="upload: the first learner uploads the model it built (default); file: the model built from "
                        "the seed is written to RUN/initial-model.safetensors and the syncer starts from it (diloco "
                        "syncer --initial-model), so no initial model crosses the network")
    add_sync_options(p)
    c = p.add_argument_group("faults")
    c.add_argument("--chaos", metavar="SCENARIO",
                   help="inject real faults: kill-one, rolling-kills, hang, straggler, syncer-crash, partition, random, "
                        "or a JSON scenario file")
    c.add_argument("--mtbf", type=float, help="mean seconds between failures for --chaos random (run length / 4)")
    n = add_network_options(p)
    n.add_argument("--http", type=address, metavar="HOST:PORT",
                   help="serve the syncer's dashboard, /status, /history and /metrics here, e.g. 127.0.0.1:8080 "
                        "(default: a free port on 127.0.0.1; with --syncer-shards N, shard i takes PORT + i)")
    o = p.add_argument_group("output")
    o.add_argument("--out", type=Path, help="run directory (default runs/<time>-<mode>)")
    o.add_argument("--json", action="store_true", help="print the report as JSON on stdout instead of the table")
    o.add_argument("--no-progress", action="store_true", help="no live display")
    o.add_argument("--snapshots", type=int, default=8, help="global-model snapshots for the eval-loss curve (8)")
    o.add_argument("--tensorboard", type=Path, metavar="DIR",
                   help="also write TensorBoard event files: each learner's curves in DIR/<id>, the global model's "
                        "held-out loss in DIR/global")
    add_config_options(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from diloco.run.local import run_local

    return run_local(args)
