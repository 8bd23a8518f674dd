"""What joining a training loop to a run costs: tokens/s and peak memory of the same CPU loop (one torch thread)
without and with `Learner.step` after every optimizer step.

    python -m benchmarks.learner.overhead --model gpt2-124m --steps 30 --repeats 3 --json runs/overhead-gpt2.json
    python -m benchmarks.learner.overhead --model builtin --steps 200 --repeats 3 --json runs/overhead-builtin.json

`gpt2-124m` is transformers' GPT2LMHeadModel(GPT2Config()) on random token ids, batch 1x64; `builtin` is the
project's own model (ModelConfig defaults) at its training batch, 16x128. Every measurement runs in a fresh
subprocess so that its peak RSS is its own; plain and with-learner runs alternate so that drift on a shared
machine hits both alike. A with-learner run joins a fresh syncer (decoupled defaults: P=24, H=24, int4 up) that
runs in a process of its own at the lowest CPU priority (nice 19), so that the syncer's CPU work, which a real run does
on another machine, takes only what the learner leaves.
Targets: overhead <= 5% in step time; peak RSS(with) - peak RSS(plain) <= 1.2x the model's fp32 size. After the timed
steps of one more with-learner run (its own: the profiler's memory would count in the RSS figures) counts what
Learner.step allocates through torch's CPU allocator over ALLOCATION_STEPS more (torch.profiler's memory events):
once warm, next to nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import multiprocessing
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from benchmarks import child_env, module_command
from diloco.procs import die_with_parent
from benchmarks.provenance import stamped

MODELS = {  # name: (batch size, sequence length) of one inner step
    "gpt2-124m": (1, 64),
    "builtin": (16, 128),
}
TARGET_OVERHEAD = 0.05
ALLOCATION_STEPS = 48
"""Steps after the timed ones over which Learner.step's allocations are counted: two cycles of P = 24."""
TARGET_RSS_OVER_MODEL = 1.2


# ---- the syncer, in a process of its own ----------------------------------------------------------------------
def _serve(conn, learners: int, overrides: dict, options: dict | None = None) -> None:
    """Body of the syncer process: serve until told to stop, then send back the final status."""
    torch.set_num_threads(1)  # leave the other cores to the learner
    os.nice(19)  # a real syncer runs on another machine: here it takes only what the learner leaves
    from diloco import ServerOptions, SyncerThread, for_mode

    syncer = SyncerThread(for_mode("decoupled", learners, **overrides),
                          ServerOptions(listen="127.0.0.1:0", http=None, **(options or {})))
    conn.send(syncer.address)
    conn.recv()
    status = syncer.stop(timeout=300)
    conn.send({k: status.get(k) for k in ("rounds", "versions", "wire_bytes", "tokens_merged")})


class SyncerProcess:
    """`with SyncerProcess() as syncer:` a decoupled-mode syncer at `syncer.address` in a spawned process;
    `syncer.final_status` holds its last status once the block is left."""

    def __init__(self, learners: int = 1, options: dict | None = None, **overrides):
        """`options`: ServerOptions fields; `overrides`: SyncConfig fields."""
        context = multiprocessing.get_context("spawn")  # a clean interpreter, no copy of this process's memory
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, learners, overrides, options), daemon=True)
        self.address = ""
        self.final_status: dict = {}

    def __enter__(self) -> SyncerProcess:
        self._process.start()
        if not self._conn.poll(120):
            self._process.kill()
            raise RuntimeError("the syncer process did not start within 120 s")
        self.address = self._conn.recv()
        return self

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(OSError, EOFError):
            self._conn.send("stop")
            if self._conn.poll(300):
                self.final_status = self._conn.recv()
        self._process.join(30)
        if self._process.is_alive():
            self._process.kill()


# ---- one measurement, in a fresh subprocess ---------------------------------------------------------------------
def build(name: str) -> tuple[torch.nn.Module, int, Callable[[torch.Tensor], torch.Tensor]]:
    """(model, vocabulary size, loss function of a (batch, seq_len + 1) token tensor), the same in every process."""
    if name == "gpt2-124m":
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config())
        return model, model.config.vocab_size, lambda rows: model(input_ids=rows[:, :-1], labels=rows[:, :-1]).loss
    from diloco.train.train_config import ModelConfig
    from diloco.train.model import build_model

    model = build_model(ModelConfig(), seed=0)
    return model, model.cfg.vocab_size, lambda rows: model(rows[:, :-1], rows[:, 1:])[1]


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def join_deadlines(transport_class) -> dict:
    """Deadlines that the first learner's upload of the whole model in fp32 fits in, with room to spare."""
    if "stall_timeout" in inspect.signature(transport_class).parameters:  # fails a transfer only when it stops moving
        return {"stall_timeout": 120.0}
    return {"rpc_timeout": 600.0}  # a fixed deadline per call


def worker(name: str, syncer: str | None, steps: int, warmup: int, count_allocations: bool = False) -> dict:
    """Train `warmup` + `steps` steps on random tokens, with a Learner when `syncer` is given; time the last `steps`."""
    from diloco import GrpcTransport, Learner  # imported by both variants, so both pay for the same imports

    torch.set_num_threads(1)
    batch, seq_len = MODELS[name]
    model, vocab, loss_of = build(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    learner = Learner(model, GrpcTransport(syncer, **join_deadlines(GrpcTransport)), "bench") if syncer else None
    rss_before_training = peak_rss_bytes()
    tokens = torch.Generator().manual_seed(0)
    in_step: list[float] = []  # seconds inside Learner.step: the training thread's own cost of the learner

    def train_step() -> float:
        rows = torch.randint(0, vocab, (batch, seq_len + 1), generator=tokens)
        loss = loss_of(rows)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.item()  # both variants read the loss, as a real loop does

    def one_step() -> None:
        value = train_step()
        if learner is not None:
            t0 = time.perf_counter()
            learner.step(tokens=batch * seq_len, loss=value)
            in_step.append(time.perf_counter() - t0)

    for _ in range(warmup):
        one_step()
    in_step.clear()
    started = time.perf_counter()
    for _ in range(steps):
        one_step()
    seconds = time.perf_counter() - started
    result = dict(variant="learner" if learner else "plain", step_seconds=seconds / steps,
                  tokens_per_second=steps * batch * seq_len / seconds,
                  model_bytes=4 * sum(p.numel() for p in model.parameters()),  # parameters() counts a tied one once
                  parameters=sum(p.numel() for p in model.parameters()),
                  peak_rss_before_training=rss_before_training, peak_rss_before_finish=peak_rss_bytes())
    if learner is not None:
        result.update(pushes=learner.pushes, applied=learner.applied, skipped=learner.skipped,
                      learner_step_seconds_total=sum(in_step), learner_step_seconds_max=max(in_step, default=0.0))
        if count_allocations:  # after the timed steps, in a run of its own: the profiler's memory would count in RSS
            result["variant"] = "allocations"
            result["learner_step_allocations"] = step_allocations(
                train_step, lambda: learner.step(tokens=batch * seq_len), ALLOCATION_STEPS)
        learner.finish()
        result.update(wire_bytes=learner.transport.wire_bytes)
    result["peak_rss"] = peak_rss_bytes()  # finish() pushes every fragment's remaining progress at once
    return result


def step_allocations(one_step: Callable[[], None], learner_step: Callable[[], None], steps: int) -> dict:
    """What `learner_step` allocates through torch's CPU allocator over `steps` more steps (torch.profiler's memory
    events on the training thread, inside each call): a learner warmed up should allocate next to nothing."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(steps):
            one_step()
            with record_function("Learner.step"):
                learner_step()
    events = prof.events()
    calls = [e for e in events if e.name == "Learner.step"]
    inside = [e for e in events if e.name != "Learner.step" and e.self_cpu_memory_usage > 0 and any(
        c.thread == e.thread and c.time_range.start <= e.time_range.start <= c.time_range.end for c in calls)]
    return dict(steps=steps, allocations_per_step=len(inside) / steps,
                bytes_per_step=sum(e.self_cpu_memory_usage for e in inside) / steps)


def measure(name: str, with_learner: bool, steps: int, warmup: int, keep_overlap: bool = True,
            count_allocations: bool = False) -> dict:
    """One worker run in a fresh interpreter (its own peak RSS), against a fresh syncer when with_learner."""
    syncer = SyncerProcess(keep_overlap=keep_overlap) if with_learner else contextlib.nullcontext()
    with syncer:
        command = [*module_command(__spec__.name), "--model", name, "--steps", str(steps), "--warmup", str(warmup),
                   "--worker"] + (["--syncer", syncer.address] if with_learner else []) + \
                  (["--count-allocations"] if count_allocations else [])
        proc = subprocess.run(command, capture_output=True, text=True, env=child_env(), preexec_fn=die_with_parent())
    if proc.returncode != 0:
        raise RuntimeError(f"worker failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if with_learner:
        result["syncer"] = syncer.final_status
    return result


# ---- the comparison ---------------------------------------------------------------------------------------------
def summarise(name: str, runs: list[dict], steps: int, warmup: int) -> dict:
    def median(variant: str, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["variant"] == variant)

    model_bytes = runs[0]["model_bytes"]
    rss_diff = median("learner", "peak_rss") - median("plain", "peak_rss")
    overhead = median("learner", "step_seconds") / median("plain", "step_seconds") - 1
    return dict(
        model=name, parameters=runs[0]["parameters"], model_bytes=model_bytes, batch=MODELS[name],
        steps=steps, warmup=warmup, repeats=sum(r["variant"] == "plain" for r in runs), torch_threads=1, sync="decoupled defaults",
        plain_tokens_per_second=median("plain", "tokens_per_second"),
        learner_tokens_per_second=median("learner", "tokens_per_second"),
        tokens_per_second_ratio=median("learner", "tokens_per_second") / median("plain", "tokens_per_second"),
        step_time_overhead=overhead,
        # the learner's cost on the training thread alone: time inside Learner.step over the run's step time
        training_thread_share=median("learner", "learner_step_seconds_total") / (steps * median("learner", "step_seconds")),
        plain_peak_rss=median("plain", "peak_rss"), learner_peak_rss=median("learner", "peak_rss"),
        rss_diff=rss_diff, rss_diff_over_model=rss_diff / model_bytes,
        rss_diff_to_last_step=median("learner", "peak_rss_before_finish") - median("plain", "peak_rss_before_finish"),
        learner_step_bytes_allocated_per_step=next(
            r["learner_step_allocations"]["bytes_per_step"] for r in runs if r["variant"] == "allocations"),
        pushes_and_applies=[(r["pushes"], r["applied"]) for r in runs if r["variant"] == "learner"],
        targets=dict(step_time_overhead=TARGET_OVERHEAD, rss_diff_over_model=TARGET_RSS_OVER_MODEL),
        meets_targets=dict(step_time_overhead=overhead <= TARGET_OVERHEAD,
                           rss_diff_over_model=rss_diff / model_bytes <= TARGET_RSS_OVER_MODEL),
        runs=runs,
    )


def print_table(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    mib = 2**20
    table = Table(title=f"{summary['model']}: {summary['parameters'] / 1e6:.1f}M parameters, batch "
                        f"{summary['batch'][0]}x{summary['batch'][1]}, 1 torch thread, medians of "
                        f"{summary['repeats']} runs of {summary['steps']} steps")
    # ru_maxrss only grows: the peak up to the join (before training), up to the last step, and overall
    for column in ("", "tokens/s", "step s", "RSS@join MiB", "RSS@last step MiB", "peak RSS MiB"):
        table.add_column(column, justify="right")
    for variant in ("plain", "learner"):
        runs = [r for r in summary["runs"] if r["variant"] == variant]
        med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
        table.add_row("with Learner" if variant == "learner" else "plain", f"{med('tokens_per_second'):,.1f}",
                      f"{med('step_seconds'):.3f}", f"{med('peak_rss_before_training') / mib:,.0f}",
                      f"{med('peak_rss_before_finish') / mib:,.0f}", f"{med('peak_rss') / mib:,.0f}")
    console = Console()
    console.print(table)
    console.print(f"step-time overhead {100 * summary['step_time_overhead']:+.1f}% (target <= "
                  f"{100 * TARGET_OVERHEAD:.0f}%); tokens/s ratio {summary['tokens_per_second_ratio']:.3f}; "
                  f"time inside Learner.step {100 * summary['training_thread_share']:.1f}% of the step time")
    console.print(f"peak RSS difference {summary['rss_diff'] / mib:,.0f} MiB = {summary['rss_diff_over_model']:.2f}x "
                  f"the fp32 model ({summary['model_bytes'] / mib:,.0f} MiB; target <= {TARGET_RSS_OVER_MODEL}x); "
                  f"up to the last step (before finish) {summary['rss_diff_to_last_step'] / mib:,.0f} MiB = "
                  f"{summary['rss_diff_to_last_step'] / summary['model_bytes']:.2f}x")
    console.print(f"Learner.step allocated {summary['learner_step_bytes_allocated_per_step'] / 1024:,.1f} KiB a step "
                  f"after warm-up (torch's CPU allocator, {ALLOCATION_STEPS} steps); pushes and applies per run "
                  f"{summary['pushes_and_applies']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="gpt2-124m")
    p.add_argument("--keep-overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="decoupled mode's apply rule (on); --no-keep-overlap measures the paper's overwrite, which "
                        "keeps no snapshot of a fragment in flight")
    p.add_argument("--steps", type=int, default=30, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before the timed ones")
    p.add_argument("--repeats", type=int, default=3, help="runs of each variant, alternating")
    p.add_argument("--json", type=Path, help="write the summary and every run here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one measurement (internal)
    p.add_argument("--syncer", help=argparse.SUPPRESS)
    p.add_argument("--count-allocations", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.model, args.syncer, args.steps, args.warmup, args.count_allocations)))
        return 0
    runs = []
    for repeat in range(args.repeats):
        for with_learner in (False, True):
            run = measure(args.model, with_learner, args.steps, args.warmup, args.keep_overlap)
            print(f"repeat {repeat + 1}/{args.repeats} {run['variant']:>7}: {run['tokens_per_second']:,.1f} tokens/s, "
                  f"peak RSS {run['peak_rss'] / 2**20:,.0f} MiB", file=sys.stderr)
            runs.append(run)
    runs.append(measure(args.model, True, args.steps, args.warmup, args.keep_overlap, count_allocations=True))
    summary = summarise(args.model, runs, args.steps, args.warmup)
    print_table(summary)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(stamped(summary, args), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
