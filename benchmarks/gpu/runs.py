"""scale.py's runs: dp and decoupled learners on one device, their comparison, the calibration and the plan."""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass, field, replace

import torch

from diloco.train.train_config import lr_at
from diloco.train.data import ShardSampler
from diloco.train.model import build_model
from benchmarks.gpu.setup import PART_SHARES, PUBLISHED_GAP, Replica, Setup, heldout_loss, sync


# ---- quality: dp and decoupled learners on one device ---------------------------------------------------------------
@dataclass
class Outcome:
    name: str
    curve: list = field(default_factory=list)
    """(tokens, held-out loss) of the global model."""
    tokens: int = 0
    seconds: float = 0.0
    stopped: str = ""
    """Why the run ended before its tokens, if it did."""
    extra: dict = field(default_factory=dict)

    @property
    def final(self) -> float:
        return self.curve[-1][1] if self.curve else float("nan")

    def to_json(self) -> dict:
        return dict(name=self.name, final_loss=self.final, tokens=self.tokens, seconds=round(self.seconds, 2),
                    tokens_per_second=self.tokens / self.seconds if self.seconds else None, curve=self.curve,
                    stopped=self.stopped or None, **self.extra)


def eval_points(total: int, n: int) -> list[int]:
    return [round(total * (i + 1) / n) for i in range(n)]


def run_dp(setup: Setup, deadline: float, name: str = "dp", shards: int = 4, log=print) -> Outcome:
    """One model on the global batch, made of `shards` shards' batches (the 4 learners' data, in their order)."""
    rep = Replica(setup)
    per = setup.batch // shards
    samplers = [ShardSampler(setup.train_tokens, i, shards, setup.model.seq_len, per, setup.train.seed)
                for i in range(shards)]
    tokens_per_step = per * shards * setup.model.seq_len
    steps = max(1, setup.tokens // tokens_per_step)
    out, points, started = Outcome(name), eval_points(steps * tokens_per_step, setup.evals), time.monotonic()
    for step in range(steps):
        batches = [s.next_batch() for s in samplers]
        x = torch.cat([b[0] for b in batches]).to(setup.device, non_blocking=True)
        y = torch.cat([b[1] for b in batches]).to(setup.device, non_blocking=True)
        rep.step(x, y, lr_at(step, setup.train, step / steps))
        out.tokens += tokens_per_step
        if points and out.tokens >= points[0]:
            points.pop(0)
            out.curve.append((out.tokens, heldout_loss(rep.model, setup.eval_data, setup.device)))
            log(f"  {name}: {out.tokens:,} tokens, held-out {out.curve[-1][1]:.4f}")
        if time.monotonic() > deadline and step < steps - 1:
            out.stopped = f"time budget: stopped after {out.tokens:,} of {steps * tokens_per_step:,} tokens"
            out.curve.append((out.tokens, heldout_loss(rep.model, setup.eval_data, setup.device)))
            break
    sync(setup.device)
    out.seconds = time.monotonic() - started
    return out


def learner_data(setup: Setup, learners: int) -> tuple[int, list, int, int]:
    """(sequences per learner step, each learner's ShardSampler, tokens per learner step, the run's tokens in whole
    learner steps): dp's global batch split `learners` ways, times `learner_batch_scale`."""
    per = max(1, round(setup.batch / learners * setup.learner_batch_scale))
    samplers = [ShardSampler(setup.train_tokens, i, learners, setup.model.seq_len, per, setup.train.seed)
                for i in range(learners)]
    tokens_per_step = per * setup.model.seq_len
    return per, samplers, tokens_per_step, max(tokens_per_step, setup.tokens // tokens_per_step * tokens_per_step)


def train_in_turns(setup: Setup, out: Outcome, reps: list, samplers: list, speeds: list[float], tokens_per_step: int,
                   total: int, steps_of, stepped, end_turn, global_loss, deadline: float, log) -> None:
    """M learners on one device stepping in turn until `total` tokens (or `deadline`): a learner of speed s steps on
    a share s of the turns; `stepped(i, data position)` after learner i's optimizer step (its `steps_of(i)` gives
    its learning rate), `end_turn()` after every turn, and `global_loss()` at each evaluation point."""
    points, credit = eval_points(total, setup.evals), [0.0] * len(reps)
    while out.tokens < total:
        for i, (rep, sampler) in enumerate(zip(reps, samplers)):
            credit[i] += speeds[i]
            if credit[i] < 1 or out.tokens >= total:
                continue
            credit[i] -= 1
            x, y = (t.to(setup.device, non_blocking=True) for t in sampler.next_batch())
            rep.step(x, y, lr_at(steps_of(i), setup.train, out.tokens / total))
            stepped(i, sampler.position)
            out.tokens += tokens_per_step
        end_turn()
        if points and out.tokens >= points[0] and out.tokens < total:
            points.pop(0)
            out.curve.append((out.tokens, global_loss()))
            log(f"  {out.name}: {out.tokens:,} tokens, held-out {out.curve[-1][1]:.4f}")
        if time.monotonic() > deadline and out.tokens < total:
            out.stopped = f"time budget: stopped after {out.tokens:,} of {total:,} tokens"
            break


def run_decoupled(setup: Setup, name: str, learners: int, preset: str, deadline: float,
                  dtypes: list[torch.dtype] | None = None, speeds: list[float] | None = None, log=print,
                  overrides: dict | None = None, trace=None) -> Outcome:
    """M learners on one device in one process, stepping in turn; a learner of speed s steps on a share s of the
    turns. The syncer is the in-process LocalSyncer; rounds that wait for time close on its tick after every turn.
    `overrides`: syncer settings over the preset's; `trace(tokens, loss, status)`: called at every evaluation."""
    from diloco import Learner, LocalSyncer, LocalTransport, for_mode
    from diloco.syncer.core import SyncerCore

    dtypes = dtypes or [torch.bfloat16] * learners
    speeds = speeds or [1.0] * learners
    cfg = for_mode("decoupled", learners, preset=preset, **(overrides or {}))
    local = LocalSyncer(SyncerCore(cfg))
    reps = [Replica(setup, dtype) for dtype in dtypes]
    members = [Learner(rep.model, LocalTransport(local), f"l{i}", speed=speeds[i]) for i, rep in enumerate(reps)]
    eval_model = build_model(setup.model, setup.train.seed).to(setup.device)
    per, samplers, tokens_per_step, total = learner_data(setup, learners)
    out, started = Outcome(name), time.monotonic()

    def held_out() -> float:
        eval_model.load_state_dict(local.core.params())
        return heldout_loss(eval_model, setup.eval_data, setup.device)

    def global_loss() -> float:
        loss = held_out()
        if trace is not None:
            trace(out.tokens, loss, local.core.status())
        return loss

    try:
        train_in_turns(setup, out, reps, samplers, speeds, tokens_per_step, total,
                       lambda i: members[i].step_count,
                       lambda i, position: members[i].step(tokens_per_step, data_position=position),
                       local.tick, global_loss, deadline, log)
        before_finish = held_out()  # what the learners' last pushes then change (not an evaluation of the trace)
        finish_all(local, members, timeout=max(30.0, deadline - time.monotonic()))
    except BaseException:
        for learner in members:
            learner.close()
        raise
    out.curve.append((out.tokens, global_loss()))  # after every learner pushed what it had left
    log(f"  {name}: {out.tokens:,} tokens, held-out {out.final:.4f} (final)")
    sync(setup.device)
    out.seconds = time.monotonic() - started
    status = local.core.status()
    out.extra = dict(learners=learners, preset=preset, learner_batch=per, sync=json.loads(cfg.to_json()),
                     before_finish=before_finish,
                     dtypes=[str(d).removeprefix("torch.") for d in dtypes], speeds=speeds,
                     rounds=status["rounds"], tokens_merged=status["tokens_merged"],
                     steps=[m.step_count for m in members], pushes=[m.pushes for m in members],
                     applied=[m.applied for m in members], skipped=[m.skipped for m in members])
    return out


def run_device(setup: Setup, name: str, learners: int, preset: str, deadline: float,
               dtypes: list[torch.dtype] | None = None, speeds: list[float] | None = None, log=print,
               overrides: dict | None = None, compile_model: bool = False) -> Outcome:
    """`run_decoupled`'s run with the learners' rounds on the device (device_rounds.DeviceRounds): nothing per step
    waits for the device, so its speed is the training's. Learners step in turn as there; rounds close at the end of
    each turn; `HONEST_LEARNERS` (no defences) over the preset's settings."""
    from benchmarks.gpu.device_rounds import HONEST_LEARNERS, DeviceRounds

    from diloco import for_mode

    dtypes = dtypes or [torch.bfloat16] * learners
    speeds = speeds or [1.0] * learners
    cfg = for_mode("decoupled", learners, preset=preset, **{**HONEST_LEARNERS, **(overrides or {})})
    reps = [Replica(setup, dtype) for dtype in dtypes]
    rounds = DeviceRounds([rep.model for rep in reps], cfg)
    if compile_model:
        for rep in reps:  # the parameters stay the ones the rounds hold
            rep.model = torch.compile(rep.model)
    eval_model = build_model(setup.model, setup.train.seed).to(setup.device)
    per, samplers, tokens_per_step, total = learner_data(setup, learners)
    out, started = Outcome(name), time.monotonic()

    def global_loss() -> float:
        eval_model.load_state_dict(rounds.params())
        return heldout_loss(eval_model, setup.eval_data, setup.device)

    train_in_turns(setup, out, reps, samplers, speeds, tokens_per_step, total, lambda i: rounds.steps[i],
                   lambda i, position: rounds.stepped(i, tokens_per_step), rounds.end_turn, global_loss, deadline,
                   log)
    sync(setup.device)
    trained = time.monotonic() - started
    before_finish = global_loss()
    for i in range(learners):
        rounds.finish(i)
    rounds.end_turn()
    out.curve.append((out.tokens, global_loss()))
    log(f"  {name}: {out.tokens:,} tokens, held-out {out.final:.4f} (final)")
    sync(setup.device)
    out.seconds = time.monotonic() - started
    out.extra = dict(learners=learners, preset=preset, learner_batch=per, sync=json.loads(cfg.to_json()),
                     before_finish=before_finish, dtypes=[str(d).removeprefix("torch.") for d in dtypes],
                     speeds=speeds, rounds=rounds.closed, steps=rounds.steps, compiled=compile_model,
                     training_tokens_per_second=out.tokens / trained if trained else None)
    return out


def finish_all(local, members, timeout: float) -> None:
    """Every learner's finish (apply what is out, push what is left, leave) at once, while this thread ticks the
    in-process syncer: the rounds they wait for close on its clock, and nothing else would tick it."""
    threads = [threading.Thread(target=m.finish, kwargs={"timeout": timeout}, daemon=True) for m in members]
    for t in threads:
        t.start()
    end = time.monotonic() + timeout
    while any(t.is_alive() for t in threads) and time.monotonic() < end:
        local.tick()
        time.sleep(0.01)
    if any(t.is_alive() for t in threads):
        raise RuntimeError(f"learners did not finish within {timeout:.0f} s")


# ---- comparisons ---------------------------------------------------------------------------------------------------
def first_reach(curve: list, target: float) -> float | None:
    """Tokens at which a (tokens, loss) curve first reaches `target`, interpolated linearly; None if never."""
    previous = (0, float("inf"))
    for tokens, loss in curve:
        if loss <= target:
            t0, l0 = previous
            if not math.isfinite(l0) or l0 == loss:
                return float(tokens)
            return t0 + (tokens - t0) * (l0 - target) / (l0 - loss)
        previous = (tokens, loss)
    return None


def quality_rows(dp: Outcome, runs: list[Outcome]) -> list[dict]:
    rows = []
    for run in runs:
        gap = run.final - dp.final
        reach = first_reach(run.curve, dp.final)
        dp_reach = first_reach(dp.curve, run.final)  # dp's tokens to this run's final loss
        m = run.extra.get("learners")
        rows.append(dict(run=run.name, learners=m, preset=run.extra.get("preset"), final_loss=run.final,
                         gap_nats=gap, published_gap_nats=PUBLISHED_GAP.get(m),
                         tokens_to_dp_final=reach, tokens_to_dp_final_ratio=reach / dp.tokens if reach else None,
                         dp_tokens_to_this_final_ratio=dp_reach / run.tokens if dp_reach and run.tokens else None,
                         stopped=run.stopped or None))
    return rows


# ---- calibration and the plan --------------------------------------------------------------------------------------
def calibrate(setup: Setup, log) -> dict[str, float]:
    """Seconds per token of dp and of 4 decoupled learners, from a few steps each (after a warm-up)."""
    probe = replace(setup, tokens=setup.batch * setup.model.seq_len * 8, evals=1)
    far = time.monotonic() + 600
    run_dp(replace(probe, tokens=setup.batch * setup.model.seq_len * 2), far, "warm-up", log=lambda *_: None)
    out = {}
    for name, run in (("dp", lambda: run_dp(probe, far, "calibrate-dp", log=lambda *_: None)),
                      ("decoupled-4", lambda: run_decoupled(probe, "calibrate-4", 4, "default", far,
                                                            log=lambda *_: None))):
        o = run()
        out[name] = o.seconds / o.tokens
        log(f"calibration: {name} {1 / out[name]:,.0f} tokens/s (with its evaluation)")
    return out


def plan_tokens(seconds: float, per_token: dict[str, float], quality_runs: int, mixed_runs: int,
                unit: int, least: int) -> tuple[int, int]:
    """Tokens per quality run and per mixed run that fit `seconds`, at the calibrated speeds (M = 2 and the mixed
    runs assumed between dp's and M = 4's, the fp32 learner slower: a margin of a fifth is kept)."""
    dp, m4 = per_token["dp"], per_token["decoupled-4"]
    quality = seconds * PART_SHARES["quality"] / (PART_SHARES["quality"] + PART_SHARES["mixed"])
    mixed = seconds - quality
    q_cost = dp + (quality_runs // 2) * ((dp + m4) / 2 + m4)  # M = 2 and M = 4, each default and paper
    q_tokens = 0.8 * quality / q_cost
    m_tokens = 0.8 * mixed / (mixed_runs * 1.5 * m4)
    return max(least * unit, int(q_tokens // unit * unit)), max(least * unit, int(m_tokens // unit * unit))
