"""gpu_scale.py's overhead part: the same loop with and without Learner.step, and its count of CUDA synchronisations."""

from __future__ import annotations

import statistics
import time

import torch

from diloco.train.config import ModelConfig
from diloco.train.model import count_parameters
from gpu_setup import OVERHEAD_GOAL, Replica, Setup, sync


# ---- overhead: the same loop with and without Learner.step ---------------------------------------------------------
def overhead(setup: Setup, size: str, model_cfg: ModelConfig, batch: int, steps: int, repeats: int,
             deadline: float, profile_steps: int = 8, log=print) -> dict:
    """Alternating phases of `steps` optimizer steps, plain and with `Learner.step`, against a syncer process over
    gRPC; then a profile of each loop for synchronisations on the training thread."""
    from diloco import GrpcTransport, Learner
    from learner_overhead import SyncerProcess, join_deadlines

    rep = Replica(setup, model=model_cfg)
    seq, vocab = model_cfg.seq_len, model_cfg.vocab_size
    gen = torch.Generator(device=setup.device).manual_seed(0)
    tokens_per_step = batch * seq
    result: dict = dict(model=size, parameters=count_parameters(rep.model), batch=[batch, seq], steps=steps)
    lr = setup.train.lr

    def steps_of(n: int, learner) -> None:
        for _ in range(n):
            rows = torch.randint(0, vocab, (batch, seq + 1), device=setup.device, generator=gen)
            rep.step(rows[:, :-1], rows[:, 1:], lr)
            if learner is not None:
                learner.step(tokens_per_step)

    def loop(n: int, learner) -> float:
        sync(setup.device)
        started = time.perf_counter()
        steps_of(n, learner)
        sync(setup.device)
        return n * tokens_per_step / (time.perf_counter() - started)

    with SyncerProcess(learners=1) as syncer:
        learner = Learner(rep.model, GrpcTransport(syncer.address, **join_deadlines(GrpcTransport)), f"bench-{size}")
        try:
            loop(min(3, steps), None), loop(min(3, steps), learner)  # warm-up: kernels, allocator, first pushes
            plain, with_learner = [], []
            for r in range(repeats):
                if r and time.monotonic() > deadline:  # one pair always runs: the part reports a figure
                    result["stopped"] = f"time budget: {r} of {repeats} repeats"
                    break
                plain.append(loop(steps, None))
                with_learner.append(loop(steps, learner))
                log(f"  {size}: repeat {r + 1}: {plain[-1]:,.0f} tokens/s plain, {with_learner[-1]:,.0f} with Learner")
            # every step pushes a fragment (P = H): a few steps show whether a push or an apply synchronises
            # (no synchronize of ours inside: what is counted is the loop's, the Learner's and the profiler's own)
            result["syncs_plain"] = profile_syncs(lambda: steps_of(profile_steps, None), setup.device)
            result["syncs_learner"] = profile_syncs(lambda: steps_of(profile_steps, learner), setup.device)
            learner.finish(timeout=120)
        except BaseException:
            learner.close()
            raise
    if plain:
        p, w = statistics.median(plain), statistics.median(with_learner)
        result.update(plain_tokens_per_second=p, learner_tokens_per_second=w, tokens_per_second_ratio=w / p,
                      overhead=1 - w / p, meets_goal=1 - w / p <= OVERHEAD_GOAL, runs_plain=plain,
                      runs_learner=with_learner, pushes=learner.pushes, applied=learner.applied)
    return result


SYNC_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemset")
"""Runtime calls that block the calling thread until the device catches up (cudaMemcpy and cudaMemset without
Async are the blocking forms)."""


def profile_syncs(body, device: torch.device) -> dict:
    """Blocking CUDA runtime calls during `body`, by thread: those on the thread that ran the matrix products (the
    training thread) and those elsewhere (the learner's sender thread may wait for its copies; that is its job)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        body()
    events = prof.events()
    by_thread: dict[int, int] = {}
    for e in events:
        if e.name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear"):
            by_thread[e.thread] = by_thread.get(e.thread, 0) + 1
    training = max(by_thread, key=by_thread.get) if by_thread else None
    on_training: dict[str, int] = {}
    elsewhere: dict[str, int] = {}
    threads: dict[str, dict] = {}  # every thread's matrix products and blocking calls, to read the trace by hand
    for e in events:
        if e.name in SYNC_CALLS:
            target = on_training if e.thread == training else elsewhere
            target[e.name] = target.get(e.name, 0) + 1
            calls = threads.setdefault(str(e.thread), {"matmuls": by_thread.get(e.thread, 0), "syncs": {}})["syncs"]
            calls[e.name] = calls.get(e.name, 0) + 1
    return dict(training_thread=sum(on_training.values()), training_thread_calls=on_training,
                other_threads=sum(elsewhere.values()), other_thread_calls=elsewhere,
                training_thread_id=training, threads=threads)
