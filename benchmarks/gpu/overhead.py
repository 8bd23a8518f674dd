"""scale.py's overhead part: the same loop with and without Learner.step, and its count of CUDA synchronisations."""

from __future__ import annotations

import statistics
import time

import torch

from diloco.train.train_config import ModelConfig
from diloco.train.model import count_parameters
from benchmarks.gpu.setup import OVERHEAD_GOAL, Replica, Setup, sync


# ---- overhead: the same loop with and without Learner.step ---------------------------------------------------------
def overhead(setup: Setup, size: str, model_cfg: ModelConfig, batch: int, steps: int, repeats: int,
             deadline: float, profile_steps: int = 8, log=print, compile_model: bool = False,
             device_codec: bool = False) -> dict:
    """Alternating phases of `steps` optimizer steps, plain and with `Learner.step`, against a syncer process over
    gRPC; then each loop's blocking waits for the device, by thread. `compile_model`: torch.compile the model;
    `device_codec`: the Learner's Δ and codec on the device."""
    from diloco import GrpcTransport, Learner
    from benchmarks.learner.overhead import SyncerProcess, join_deadlines

    rep = Replica(setup, model=model_cfg)
    if compile_model:
        rep.model = torch.compile(rep.model)
    seq, vocab = model_cfg.seq_len, model_cfg.vocab_size
    gen = torch.Generator(device=setup.device).manual_seed(0)
    tokens_per_step = batch * seq
    result: dict = dict(model=size, parameters=count_parameters(rep.model), batch=[batch, seq], steps=steps,
                        compiled=compile_model, device_codec=device_codec)
    lr = setup.train.lr

    in_learner: list[float] = []  # host seconds of each Learner.step call in the timed phases

    def steps_of(n: int, learner) -> None:
        for _ in range(n):
            rows = torch.randint(0, vocab, (batch, seq + 1), device=setup.device, generator=gen)
            rep.step(rows[:, :-1], rows[:, 1:], lr)
            if learner is not None:
                started = time.perf_counter()
                learner.step(tokens_per_step)
                in_learner.append(time.perf_counter() - started)

    def loop(n: int, learner) -> float:
        sync(setup.device)
        started = time.perf_counter()
        steps_of(n, learner)
        sync(setup.device)
        return n * tokens_per_step / (time.perf_counter() - started)

    with SyncerProcess(learners=1) as syncer:
        learner = Learner(rep.model, GrpcTransport(syncer.address, **join_deadlines(GrpcTransport)), f"bench-{size}",
                          device_codec=device_codec)
        try:
            loop(min(3, steps), None), loop(min(3, steps), learner)  # warm-up: kernels, allocator, first pushes
            in_learner.clear()
            plain, with_learner = [], []
            for r in range(repeats):
                if r and time.monotonic() > deadline:  # one pair always runs: the part reports a figure
                    result["stopped"] = f"time budget: {r} of {repeats} repeats"
                    break
                plain.append(loop(steps, None))
                with_learner.append(loop(steps, learner))
                log(f"  {size}: repeat {r + 1}: {plain[-1]:,.0f} tokens/s plain, {with_learner[-1]:,.0f} with Learner")
            # every step pushes a fragment (P = H): a few steps show whether a push or an apply synchronises
            result["learner_step_host_ms"] = dict(
                median=1e3 * statistics.median(in_learner), mean=1e3 * statistics.fmean(in_learner),
                max=1e3 * max(in_learner)) if in_learner else {}
            result["syncs_plain"] = count_waits(lambda: steps_of(profile_steps, None), setup.device)
            result["syncs_learner"] = count_waits(lambda: steps_of(profile_steps, learner), setup.device)
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


def count_waits(body, device: torch.device) -> dict:
    """Blocking waits for the device during `body`, by the thread that waited: Python-level waits (`Event`/`Stream`
    `.synchronize`, `torch.cuda.synchronize`) and every synchronising operation PyTorch detects itself
    (`torch.cuda.set_sync_debug_mode`, whose warning is raised in the thread that synchronised). The profiler's
    trace is not used for this: on CUDA it filed every runtime call under one thread, the sender's waits with the
    training thread's (an H200 run of benchmarks/gpu/learner_profile.py found all of them on the sender thread)."""
    import threading
    import warnings

    training = threading.current_thread().name
    by_thread: dict[str, dict[str, int]] = {}

    def note(call: str) -> None:
        calls = by_thread.setdefault(threading.current_thread().name, {})
        calls[call] = calls.get(call, 0) + 1

    def counting(name, original):
        def wait(*args, **kwargs):
            note(name)
            return original(*args, **kwargs)
        return wait

    patched = [(torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize"), (torch.cuda, "synchronize")]
    saved = [getattr(owner, attr) for owner, attr in patched]
    for (owner, attr), original in zip(patched, saved):
        setattr(owner, attr, counting(f"{getattr(owner, '__name__', 'torch.cuda')}.{attr}", original))

    def shown(message, category, *args, **kwargs):
        if "synchroniz" in str(message):
            note("synchronising operation (sync debug mode)")

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = shown
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("warn")
            try:
                body()
            finally:
                if device.type == "cuda":
                    torch.cuda.set_sync_debug_mode("default")
    finally:
        for (owner, attr), original in zip(patched, saved):
            setattr(owner, attr, original)
    on_training = by_thread.get(training, {})
    elsewhere: dict[str, int] = {}
    for name, calls in by_thread.items():
        if name != training:
            for call, n in calls.items():
                elsewhere[call] = elsewhere.get(call, 0) + n
    return dict(training_thread=sum(on_training.values()), training_thread_calls=on_training,
                other_threads=sum(elsewhere.values()), other_thread_calls=elsewhere, threads=by_thread)
