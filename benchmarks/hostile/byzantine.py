"""Hostile learners: one of four learners attacks for a whole run; how far is the final model from an honest run's?

    python -m benchmarks.hostile.byzantine --model tiny --steps 300 --seeds 0 --json runs/byzantine.json
    python -m benchmarks.hostile.byzantine --markdown runs/byzantine.json

Every run is a `diloco run` of three honest learners on this machine, joined from its start by a fourth learner
started here: honest (the baseline), or hostile with one attack for the whole run. The hostile learner trains the
built-in model on real data like the others and changes what it sends:

| attack | what it sends |
|---|---|
| `sign-flip` | −Δ |
| `noise` | random directions as large as the outlier guard admits: 0.9 × its 50× bound (taken on its own honest Δ), and under its ceiling |
| `drift` | Δ plus half its norm along one fixed direction per fragment, every push: a slow targeted drift |
| `free-rider` | zeros, claiming four times its tokens |
| `replay` | the payload it pushed ten pushes of that fragment ago, again, as new |
| `stale` | the Δ it pushed ten pushes of that fragment ago, encoded again with noise of a hundredth of its size (cosine 0.99999 with it), so that some of its int4 bytes are new: a replay that the byte-for-byte refusal does not see |
| `inflate-tokens` | its real Δ, claiming 24·2^32 tokens per push |
| `tiny-weight` | its real Δ, declaring 1 token in 2^53 steps (a weight of ~10^-31) |
| `heartbeat-tokens` | its real Δ, and heartbeats claiming 10^9 tokens more each time |
| `flip-some` | −Δ on two of every five pushes of a fragment, its real Δ on the others: fewer than half of its recent pushes |
| `noise-aligned` | `noise` plus its own Δ scaled so that the cosine with Δ is 0.6 (its Δ is what it knows of the run's recent direction) |
| `alie` | "A little is enough" (Baruch et al. 2019, arXiv 1902.06156): its Δ moved, coordinate by coordinate, one standard deviation against the mean's sign; mean and deviation taken over its own last five pushes of the fragment |
| `ipm` | inner-product manipulation (Xie et al. 2019, arXiv 1903.03936): −1.9 × the mean of its last five pushes of the fragment, at the norm of its own Δ, so just inside the robust merge's clip of 2× |

Each run gets the same per-learner step budget (`--steps`), so the honest learners do the same work whatever the
fourth sends; the table gives each run's final held-out loss against the all-honest run's, and against three honest
learners alone (`--learners 3`, what ignoring the fourth perfectly would give). The defences are the syncer's flags:
pass `--syncer-flags "--clip-norm-ratio 0"` to run without the robust merge, `--syncer-flags "--direction-floor 0"` to
run without the direction test, `--syncer-flags "--preset paper"` to see what the published algorithm alone does.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from benchmarks import child_env, module_command
from diloco.procs import die_with_parent
from benchmarks.provenance import stamped

ATTACKS = ("sign-flip", "noise", "drift", "free-rider", "replay", "inflate-tokens", "tiny-weight", "heartbeat-tokens",
           "flip-some", "noise-aligned", "alie", "ipm", "stale")
RECENT = 5
"""Own pushes of a fragment that `alie` and `ipm` estimate the honest mean (and spread) from."""


# ---- the hostile learner (this script, run with --hostile ATTACK) ----

def attacked(attack: str, delta, pushes_before: int, generator, directions: dict, fragment: int,
             recent: list | None = None):
    """What the hostile learner sends instead of its honest Δ of `fragment` (None: Δ itself), given how many pushes
    of that fragment it made before this one and its own recent honest Δs of it (this one last). Counter attacks
    change the job, not Δ (`hostile_transport`)."""
    import torch

    norm = delta.norm().item()
    if attack == "sign-flip" or (attack == "flip-some" and pushes_before % 5 in (1, 3)):
        return -delta
    if attack == "noise":
        noise = torch.randn(delta.numel(), generator=generator)
        return noise * (0.9 * 50 * norm / noise.norm().item())
    if attack == "noise-aligned":  # cos(noise + c·Δ, Δ) = c‖Δ‖ / ‖noise + c·Δ‖ = 0.6 for noise ⟂ Δ
        noise = torch.randn(delta.numel(), generator=generator)
        noise -= (noise @ delta) / max(norm * norm, 1e-30) * delta
        size = 0.9 * 50 * norm / 1.25  # ‖noise‖ = 0.8 of the whole, which is 0.9 × the guard's bound as in `noise`
        return noise * (size / noise.norm().item()) + delta * (0.75 * size / max(norm, 1e-30))
    if attack == "drift":
        d = directions.get(fragment)
        if d is None:
            d = torch.randn(delta.numel(), generator=generator)
            d = directions[fragment] = d / d.norm()
        return delta + 0.5 * norm * d
    if attack == "free-rider":
        return torch.zeros_like(delta)
    if attack in ("alie", "ipm"):
        recent = recent or [delta]
        mean = torch.stack(recent).mean(0)
        if attack == "ipm":
            return mean * (-1.9 * norm / max(mean.norm().item(), 1e-30))
        if len(recent) < 2:
            return None  # no spread to hide in yet
        return delta - torch.stack(recent).std(0) * torch.sign(mean)
    return None


def stale(payload, generator):
    """`payload`'s Δ encoded again (same codec) with noise of a hundredth of its norm: new bytes, the same step."""
    import torch

    from diloco.algorithm import codec

    old = codec.decode(payload)
    noise = torch.randn(old.numel(), generator=generator)
    return codec.encode(old + noise * (1e-2 * old.norm().item() / max(noise.norm().item(), 1e-30)), payload.codec)


def hostile_transport(attack: str, seed: int):
    """A GrpcTransport whose pushes and heartbeats carry `attack`."""
    import torch

    from diloco.algorithm import codec
    from diloco.learner.grpc_transport import GrpcTransport

    class Hostile(GrpcTransport):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.history: dict[int, list] = {}
            self.recent: dict[int, list] = {}
            self.directions: dict[int, torch.Tensor] = {}
            self.generator = torch.Generator().manual_seed(seed)
            self.claimed = 0

        def push(self, job) -> None:
            payload = job.payload(self.config.codec)  # the honest Δ, encoded once: the sender reuses it
            kept = self.history.setdefault(job.fragment, [])
            delta = codec.decode(payload)
            recent = self.recent.setdefault(job.fragment, [])
            recent[:] = [*recent[-(RECENT - 1):], delta]
            changed = attacked(attack, delta, len(kept), self.generator, self.directions, job.fragment, recent)
            kept.append(payload)
            if attack == "free-rider":
                job.tokens = 4 * job.tokens
            elif attack == "replay" and len(kept) > 10:
                job._payload = kept[-11]
            elif attack == "stale" and len(kept) > 10:
                job._payload = stale(kept[-11], self.generator)
            elif attack == "inflate-tokens":
                job.tokens = job.steps * 2**32
            elif attack == "tiny-weight":
                job.tokens, job.steps = 1, 2**53
            if changed is not None:
                job._payload = codec.encode(changed, self.config.codec)
            super().push(job)

        def report(self, **progress) -> None:
            if attack == "heartbeat-tokens" and progress.get("tokens_trained") is not None:
                self.claimed += 10**9
                progress["tokens_trained"] += self.claimed
            super().report(**progress)

    return Hostile


def run_hostile(args) -> int:
    """The fourth learner: the built-in trainer over a hostile transport."""
    import torch

    from diloco.train.train_config import TrainConfig
    from diloco.train.loop import WorkerOptions, run_learner, train_config_from_json

    torch.set_num_threads(1)
    cfg = train_config_from_json(Path(args.train_config).read_text()) if args.train_config else TrainConfig()
    cls = hostile_transport(args.hostile, args.seed)
    transport = cls(args.syncer, connect_timeout=120)
    opts = WorkerOptions(args.id, 3, 4, 1.0, None, args.steps, None)
    summary = run_learner(cfg, transport, opts)
    print(json.dumps(summary))
    return 0


# ---- the benchmark ----

def one_run(name: str, attack: str | None, args, seed: int, out: Path, learners: int = 3) -> dict:
    """A `diloco run` of `learners` honest learners, and, unless `attack` is "none", a fourth learner joining it."""
    folder = out / f"{name}@{seed}"
    attempt = 0
    while folder.exists():
        attempt += 1
        folder = out / f"{name}@{seed}.{attempt}"
    cmd = [sys.executable, "-m", "diloco", "run", "--model", args.model, "--learners", str(learners), "--seed",
           str(seed), "--steps", str(args.steps), "--json", "--no-progress", "--out", str(folder),
           *shlex.split(args.syncer_flags)]
    run = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                           preexec_fn=die_with_parent())
    fourth = None
    try:
        if attack is not None:
            address = wait_for_address(folder, run)
            cmd4 = [*module_command(__spec__.name), "--hostile", attack, "--syncer", address, "--id", "fourth",
                    "--steps", str(args.steps), "--seed", str(seed), "--train-config", str(folder / "train_config.json")]
            fourth = subprocess.Popen(cmd4, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
                                      start_new_session=True, preexec_fn=die_with_parent())
        stdout, stderr = run.communicate(timeout=args.timeout)
        if run.returncode != 0:
            raise RuntimeError(f"{name}@{seed}: diloco run failed ({run.returncode}): {stderr[-1500:]}")
        report = json.loads(stdout)
    finally:
        for proc in (run, fourth):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    fourth_summary = None
    if fourth is not None:
        try:
            out4, err4 = fourth.communicate(timeout=60)
            fourth_summary = json.loads(out4.strip().splitlines()[-1]) if out4.strip() else {"error": err4[-500:]}
        except (subprocess.TimeoutExpired, json.JSONDecodeError):
            fourth_summary = {"error": "no summary"}
    syncer = {}
    for state in folder.glob("**/syncer.json"):
        syncer = json.loads(state.read_text())
    return {"attack": attack, "seed": seed, "final_loss": report["final_eval_loss"],
            "initial_loss": report.get("initial_eval_loss"), "tokens_trained": report.get("tokens_trained"),
            "wall_seconds": report.get("wall_seconds"), "fourth": fourth_summary,
            "refusals": syncer.get("refusals"), "dropped_rounds": syncer.get("dropped_rounds"),
            "folder": str(folder)}


def wait_for_address(folder: Path, run: subprocess.Popen, timeout: float = 300.0) -> str:
    """The syncer's gRPC address, once the run has one (its ready.json)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for ready in folder.glob("**/ready.json"):
            try:
                return f"127.0.0.1:{json.loads(ready.read_text())['grpc_port']}"
            except (ValueError, KeyError, OSError):
                pass  # being written
        if run.poll() is not None:
            raise RuntimeError(f"diloco run exited ({run.returncode}) before its syncer was ready; see {folder}/logs")
        time.sleep(0.2)
    raise RuntimeError(f"no syncer address in {folder} after {timeout:.0f} s")


def table(results: dict) -> str:
    rows = ["| fourth learner | final loss | vs all-honest | vs three honest alone | dropped rounds | refusals |",
            "|---|---|---|---|---|---|"]
    by = {}
    for r in results["runs"].values():
        by.setdefault(r["attack"] or "none (3 learners)", []).append(r)
    honest = [r["final_loss"] for r in by.get("honest", [])]
    alone = [r["final_loss"] for r in by.get("none (3 learners)", [])]
    for name in ["honest", "none (3 learners)", *ATTACKS]:
        runs = by.get(name)
        if not runs:
            continue
        loss = statistics.fmean(r["final_loss"] for r in runs)
        rel = lambda ref: f"{100 * (loss / statistics.fmean(ref) - 1):+.1f}%" if ref else "–"  # noqa: E731
        dropped = sum(r.get("dropped_rounds") or 0 for r in runs)
        refusals = sum(sum((r.get("refusals") or {}).values()) for r in runs)
        rows.append(f"| {name} | {loss:.3f} | {rel(honest)} | {rel(alone)} | {dropped} | {refusals} |")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attacks", default=",".join(ATTACKS), help=f"comma-separated, of {', '.join(ATTACKS)}")
    p.add_argument("--model", default="tiny", choices=("tiny", "small"))
    p.add_argument("--steps", type=int, default=300, help="inner steps per learner (every run the same)")
    p.add_argument("--seeds", default="0")
    p.add_argument("--syncer-flags", default="", help="extra `diloco run` flags for every run (the defences)")
    p.add_argument("--json", type=Path, help="write (and resume) the results here")
    p.add_argument("--markdown", type=Path, help="print the table of a results file and exit")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take")
    p.add_argument("--out", type=Path, default=Path("runs/byzantine"))
    # the hostile learner itself
    p.add_argument("--hostile", choices=("honest", *ATTACKS), help=argparse.SUPPRESS)
    p.add_argument("--syncer", help=argparse.SUPPRESS)
    p.add_argument("--id", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--train-config", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.hostile:
        return run_hostile(args)
    if args.markdown:
        print(table(json.loads(args.markdown.read_text())))
        return 0
    attacks = [a for a in args.attacks.split(",") if a]
    unknown = set(attacks) - set(ATTACKS)
    if unknown:
        p.error(f"unknown attack(s) {', '.join(sorted(unknown))}; choose from {', '.join(ATTACKS)}")
    results = {"settings": vars(args) | {"json": str(args.json), "out": str(args.out), "markdown": None}, "runs": {}}
    if args.json and args.json.exists():
        earlier = json.loads(args.json.read_text())
        results["runs"] = earlier["runs"]
        results.update({k: earlier[k] for k in ("provenance", "provenance_more") if k in earlier})
    args.out.mkdir(parents=True, exist_ok=True)
    plan = [("honest", "honest"), ("alone", None), *((a, a) for a in attacks)]
    for seed in (int(s) for s in args.seeds.split(",")):
        for name, attack in plan:
            key = f"{name}@{seed}"
            if key in results["runs"]:
                continue
            started = time.monotonic()
            print(f"[{key}] running …", file=sys.stderr, flush=True)
            r = one_run(name, attack, args, seed, args.out)
            results["runs"][key] = r
            print(f"[{key}] final loss {r['final_loss']:.4f} in {time.monotonic() - started:.0f} s", file=sys.stderr,
                  flush=True)
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(stamped(results, args), indent=1))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
