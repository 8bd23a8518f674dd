"""Quality and bandwidth of several modes at an equal token budget: the figures in docs/results.md.

    python -m benchmarks.quality.compare_modes --tokens 1800000 --modes dp,decoupled --out runs/compare

Each mode is one `diloco run` (same model, data, seed and token budget); the table compares final held-out loss,
wire bytes and goodput, with ratios against the first mode listed. Extra flags after `--` go to every run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table
from diloco.procs import die_with_parent
from benchmarks.provenance import stamped


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1_800_000, help="token budget of every run")
    p.add_argument("--modes", default="dp,decoupled", help="comma-separated modes; the first is the reference")
    p.add_argument("--learners", type=int, default=4)
    p.add_argument("--out", type=Path, default=Path("runs/compare"))
    p.add_argument("extra", nargs=argparse.REMAINDER, help="flags passed to every `diloco run` (after --)")
    args = p.parse_args()
    extra = [a for a in args.extra if a != "--"]
    reports = {}
    for mode in args.modes.split(","):
        out = args.out / mode
        cmd = [sys.executable, "-m", "diloco", "run", "--mode", mode, "--learners", str(args.learners),
               "--tokens", str(args.tokens), "--json", "--out", str(out), *extra]
        print("running:", " ".join(cmd[2:]), file=sys.stderr)
        proc = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=die_with_parent())
        if proc.returncode != 0:
            print(proc.stderr[-2000:], file=sys.stderr)
            return proc.returncode
        reports[mode] = json.loads(proc.stdout)
    ref = reports[args.modes.split(",")[0]]
    table = Table(title=f"equal budget: {args.tokens:,} tokens, {args.learners} learners")
    for col in ("mode", "tokens", "wall s", "final loss", "vs ref", "wire MiB", "ref/this wire", "goodput", "uptime"):
        table.add_column(col, justify="right")
    for mode, r in reports.items():
        table.add_row(mode, f"{r['tokens_trained']:,}", f"{r['wall_seconds']:.0f}", f"{r['final_eval_loss']:.4f}",
                      f"{100 * (r['final_eval_loss'] / ref['final_eval_loss'] - 1):+.2f}%",
                      f"{r['wire_bytes'] / 2**20:,.1f}", f"{ref['wire_bytes'] / max(r['wire_bytes'], 1):,.1f}×",
                      f"{r['goodput']:.3f}", f"{r['uptime']:.3f}")
    Console().print(table)
    (args.out / "summary.json").write_text(json.dumps(stamped({m: {k: r[k] for k in (
        "tokens_trained", "wall_seconds", "final_eval_loss", "initial_eval_loss", "wire_bytes", "goodput", "uptime")}
        for m, r in reports.items()}, args), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
