"""The run's synchronisation settings, shared by the syncer and every learner, and the named modes."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace

from diloco.algorithm.codec import check_codec
from diloco.algorithm.policy import PolicyConfig

MODES = ("decoupled", "streaming", "diloco", "dp")
WIRE_COMPRESSIONS = ("none", "zstd")
"""Values of `SyncConfig.wire_compression` (diloco.wire.compression)."""
PRESETS = ("default", "paper")
REPEAT_PUSHES = ("close", "replace")
"""Values of `SyncConfig.repeat_push`."""

PAPER = dict(
    keep_overlap=False, align_pushes=False, grace_expect_steps=0.0, scale_partial_rounds=False, split_tensors=False,
    delayed_momentum=False, clamp_long_contributions=False, publish_to="live", max_norm_ratio=0.0, norm_ceiling=0.0, clip_norm_ratio=0.0,
    max_counter_ratio=0.0, max_round_ratio=0.0, direction_floor=0.0, agreement_floor=0.0, refuse_replays=False,
    outer_lr=0.7,
    outer_momentum=0.9, blend=0.0, staleness_decay=0.0, max_steps_ratio=0.0, error_feedback=False, down_codec="fp32",
    grace=None, grace_gamma=0.5, grace_cap_steps=1.0, rda_mean_fallback=True, merge_at_close=False,
    bf16_residual=False, wire_compression="none", repeat_push="replace",
)
"""The published algorithm (docs/algorithm.md) exactly: every mechanism of this project off, DiLoCo's outer η/μ, Θ sent
back in fp32. The mode still sets P, K, τ, the codec and the merge rule."""


@dataclass(frozen=True)
class SyncConfig:
    mode: str = "decoupled"
    """Named mode that chose the defaults below: decoupled, streaming or diloco (dp has no syncer)."""
    preset: str = "default"
    """default: this project's measured choices on top of the mode; paper: the published algorithm exactly (every
    mechanism below marked as ours off, DiLoCo's η = 0.7 and μ = 0.9, merged fragments sent back in fp32). With K = 1
    the paper's Nesterov step on every round is unstable (docs/results.md, "The paper preset"); `momentum_every`
    is the published remedy."""
    fragments: int = 24
    """P: number of fragments the model is split into; one is exchanged every H/P steps."""
    split_tensors: bool = False
    """Ours (the paper's fragments are whole tensors). Cut a tensor larger than a fragment's share of the model into
    pieces in several fragments, so that no fragment is much larger than a P-th of the model: a learner's costliest
    push and apply shrink with it (a GPT's tied embedding and head are 47% of a 36M model, 31% of GPT-2). RDA then
    takes each piece's norm instead of its tensor's. Not with a sharded syncer (each shard writes whole tensors)."""
    sync_every: int = 24
    """H: inner steps between two pushes of the same fragment."""
    overlap: int = 2
    """τ: inner steps between pushing a fragment and applying the merged one (communication hides behind them)."""
    quorum: int = 1
    """K: distinct learners a round needs before it may close; fewer when fewer are live (a learner absent for
    absent_after_seconds, or gone, does not hold the others' rounds, even with K = all)."""
    wait_for_merge: bool = False
    """Block the training thread when a merged fragment is due but has not arrived (streaming, diloco)."""
    grace: float | None = None
    """Fixed grace window in seconds after quorum; None selects the adaptive window (docs/algorithm.md §4)."""
    grace_gamma: float = 0.5
    """Share γ of the overlap's free time the adaptive grace window may use."""
    grace_cap_steps: float = 1.0
    """Cap of the adaptive grace window, in learner step times."""
    grace_expect_steps: float = 0.0
    """Ours (0 is the paper's window alone; decoupled mode: H, one cycle, by measurement, benchmarks/LOG.md). Also keep
    a round open for live learners whose push of the fragment is predicted (from their last push and step time)
    within this many step times of the round's opening. Learners never wait for it: a later merged fragment is
    applied when it arrives (with keep_overlap, without losing the steps taken meanwhile)."""
    align_pushes: bool = False
    """Ours. Keep each learner's push schedule in phase with the longest-running learner of similar speed: one the
    syncer reports k ≥ 1 steps behind pushes the next k steps' fragments early as well, one k ahead pushes
    nothing for k steps (at most one correction every 4 steps). Equal-speed learners otherwise drift apart and
    fill rounds apart."""
    codec: str = "int4"
    """Codec of the outer gradients learners push: fp32, bf16, int8 or int4."""
    down_codec: str = "int8"
    """Codec of merged fragments sent back; below fp32 the syncer sends the change from what the learner holds."""
    wire_compression: str = "none"
    """Ours. zstd-compress int4/int8 payloads both ways (none or zstd): 5–17% fewer bytes on real outer gradients
    for the CPU of compressing them (benchmarks/LOG.md, Fewer bytes). Learners follow the syncer's setting."""
    error_feedback: bool = False
    """Carry each fragment's quantisation error into its next push (learner side)."""
    merge: str = "rda"
    """Merge rule for non-embedding tensors: rda (radial-directional averaging) or mean."""
    rda_mean_fallback: bool = False
    """Ours when off (on is the paper's). RDA falls back to the weighted mean where the contributions' mean direction
    vanishes (docs/algorithm.md §4). Off, such a tensor merges to 0 (unit(0) = 0), and an open round keeps one running sum, Σ w·unit(Δ), instead
    of two: half the memory of every round in flight and three memory streams per contribution instead of five
    (benchmarks/LOG.md). The fallback is rare: `diloco_rda_vanished_total` counts it."""
    merge_at_close: bool = True
    """Ours. Keep an open round's contributions as their payloads (in memory up to the kept-payload budget, on disk
    beyond; int4: an eighth of their fp32 size) and fold them into the round's sums when it closes, one at a time,
    instead of keeping running fp32 sums while it is open. A syncer then holds no sums for its open rounds, which are
    all of them at once when many learners finish together, and none per contributor with `repeat_push` replace.
    The same merge to float rounding; each contribution is decoded twice. Measured (benchmarks/LOG.md, "Rounds
    merged when they close"): six more learners added 0.40× the model to the syncer's peak instead of 0.94×, for no
    more CPU per push, so it is on by default."""
    scale_partial_rounds: bool = True
    """Ours (the paper takes a full outer step every round). Scale a round's merged Δ by the share of the expected tokens it carries (its tokens over those plus the
    typical contribution of each live learner missing from it). 1 when everyone contributes; with K = 1 and
    learners out of step it keeps M one-learner rounds from each taking a full outer step."""
    clamp_long_contributions: bool = True
    """Ours. Count a contribution of more than H local steps as H steps in weights and round shares (its tokens
    scaled by H / steps): a learner back from a long disconnection does not take most of a round. Off, the weight
    is tokens² / steps whatever the length (the paper)."""
    publish_to: str = "contributors"
    """Ours ("live" is the paper's). Who receives a merged fragment: contributors (each learner gets it in answer to
    its own push, so no learner's progress is overwritten before it is pushed) or live (docs/algorithm.md §4: every live
    learner; one with no push of the fragment in flight applies it at once, overwriting its progress on the
    fragment since its last apply). live needs down_codec fp32."""
    delayed_momentum: bool = True
    """Ours. Advance the outer momentum once per full round's worth of contributions; partial rounds take plain
    steps in between. Identical to Nesterov when every round is full; keeps K = 1 from diverging."""
    momentum_every: int = 1
    """Delayed Nesterov (Liu et al. 2024, "Asynchronous Local-SGD Training for Language Modeling"): advance the outer
    momentum once every N = this many rounds' worth of contributions (counted in shares with `delayed_momentum`, else
    in rounds), with the mean of their Δ; the rounds in between take plain steps Θ ← Θ − η·Δ/N. Over N rounds Θ then
    moves as one synchronous DiLoCo round would on their mean Δ. 1: every (full) round. With K = 1 each round holds about one learner, so
    N = M makes the momentum see about one synchronous round's progress at a time; DiLoCo's η 0.7 / μ 0.9 applied to
    every such round extrapolates stale, one-learner progress and diverged (docs/results.md, "The paper preset")."""
    outer_lr: float = 0.7
    """η of the Nesterov outer optimizer (DiLoCo's 0.7; decoupled mode uses 1.0)."""
    outer_momentum: float = 0.9
    """μ of the Nesterov outer optimizer (DiLoCo's 0.9; decoupled mode uses 0)."""
    blend: float = 0.0
    """α: a learner sets θ ← α·θ + (1−α)·Θ on apply; 0 overwrites (the published default)."""
    keep_overlap: bool = False
    """Ours (off is the paper's overwrite; decoupled mode: on, by measurement, benchmarks/LOG.md). On apply, keep the
    local progress made since the push: θ ← Θ + (θ − θ at push), instead of discarding the steps between push and
    apply (overwrite). Their steps and tokens then count toward the next push. Costs the learner what it needs to
    read the values at each push back: the pushed bf16 Δ (CPU, int4) or an fp32 snapshot, per fragment in flight,
    and the encoded changes that answer it until the apply."""
    bf16_residual: bool = True
    """Ours (the paper keeps Θ in fp32; with a down codec below fp32, so does off). Once a lossy downlink makes the
    published values P differ from Θ, keep Θ as P + (Θ − P) in bf16 instead of a second fp32 copy: half a model
    less syncer memory. Θ − P is the quantisation error of the last change sent, so the rounding this adds is
    about 2^-9 of that error, a few hundred-thousandths of a change (benchmarks/LOG.md, "Syncer memory")."""
    sync_buffers: bool = True
    """Average floating-point buffers (e.g. BatchNorm running statistics) across learners: each learner sends them
    with its push of fragment 0 (every H steps) and the syncer sets them to the token-weighted mean of what arrived.
    False keeps them local after join. Frozen parameters and integer buffers are set from the global model on
    join and never merged either way."""
    staleness_decay: float = 0.0
    """λ: a contribution's weight is divided by (1 + λ·staleness)."""
    repeat_push: str = "close"
    """Ours when close (replace is the paper's, docs/algorithm.md §4). What a push does when the same learner's earlier push of
    the fragment is still pending in an open round. close: that round is closed first, the earlier push merged in it
    alone, and the new push opens the next round; a newer push that carries the earlier one's progress too (a Δ from
    the same base, which the built-in learner never sends: it does not push a fragment whose result is still out)
    then has that progress merged twice. replace: the new push takes the earlier one's place in the round, whose
    opening and quorum times stay; it counts with its own counters when it has the same session and base version and
    counters at least as large (they cover the earlier push's progress), else with the sum of both. Every open round
    then keeps each contributor's decoded Δ (the fragment's fp32 size each) to rebuild its sums from."""
    max_staleness: int = 16
    """Contributions staler than this many versions are refused and the learner resynchronises."""
    max_steps_ratio: float = 0.0
    """Ours. Refuse (and resynchronise) a contribution covering more than this many times H local steps (0: off, the
    default). Only a long disconnection produces one; merged, it counts as H steps in weights and shares, which
    keeps its work without letting it overshoot, so refusing is rarely worth the lost work."""
    max_norm_ratio: float = 50.0
    """Ours. Refuse a contribution whose norm per step exceeds this multiple of the median of the fragment's recent
    accepted contributions (0: off). Generous because a learning-rate warmup alone changes norms per step by up to
    its ramp (20× here). When most learners exceed it together, their norms become the reference."""
    norm_ceiling: float = 1.0
    """Ours. Refuse, from a run's first push, a contribution whose norm per step exceeds this multiple of the fragment's
    own norm (0: off). Honest AdamW steps measure 0.003–0.11 of it (GPT-2 at lr 6e-4 to 1e-2)."""
    clip_norm_ratio: float = 2.0
    """Ours, the robust merge (0: off; on by measurement, docs/results.md, "Hostile learners"). Scale a contribution
    down, before it is merged, to this multiple of the norm per step that other credentials' accepted contributions
    of the fragment typically have (a prior from the fragment's own norm bounds the first pushes, while fewer than
    two others have any): a hostile push moves the model at most as far as this many honest ones, and colluding ids
    of one credential do not move the reference. At 4 (the earlier default) one learner in four pushing noise, or
    noise with a component along its own Δ, still cost +8.9% and +35.7% of the final loss; at 2, +2.3% and +2.1%,
    within the noise of ignoring that learner, for −0.005, −0.016 and +0.033 nats on honest runs of three seeds."""
    direction_floor: float = 0.25
    """Ours, the direction test (0: off; on by measurement). Merge a parameter contribution with its Δ and weight
    scaled by c / (this × typical), at most 1 and at least 0: c is the median of its credential's recent cosines
    with the fragment's recent published steps (a decaying sum of them, kept in bf16: half a model more syncer
    memory), this one included, and typical the median over other credentials of theirs. A learner pushing
    sign-flipped (c < 0) or random (c ≈ 0) outer gradients is merged with (near) no weight; an honest step that
    points back now and then keeps its weight. Everything passes until the reference took in two rounds with
    contributors of three credentials, and while the others' typical cosine is under 0.1
    (syncer/defences/direction_guard.py). Measured at the clip of 2 (docs/results.md, "Hostile learners"; one learner in
    four hostile, three seeds): a sign flip +3.3% → +0.3% of an honest run's final loss, inner-product
    manipulation +10.3% → +2.8%, flips on two pushes in five +6.8% → +3.3%; on honest runs +0.013, −0.005 and
    −0.003 nats (two runs of one setting differed by 0.005–0.015), so it is on by default."""
    refuse_replays: bool = True
    """Ours. Refuse a parameter push whose payload repeats, byte for byte, one accepted for the same fragment among
    its last 256 (a credential holder replaying old pushes as new; a resent push keeps its sequence number and is
    a duplicate instead). Honest pushes of a real fragment never repeat; all-zero payloads and fragments under 1,024
    values, whose int4 payloads can repeat honestly, are exempt (syncer/defences/replayed.py)."""
    agreement_floor: float = 0.25
    """Ours, the agreement test (0: off; on by measurement). Merge a parameter contribution with its Δ and weight
    scaled by s / (this × typical), at most 1 and at least 0: s is its score, the ⌈n/2⌉-th largest cosine with the
    n other credentials' contributions in its own round and their latest in the fragment's last two rounds (it
    agrees with at least half of them), estimated from a 4,096-value sketch of each Δ, and typical the median of
    those others' scores. Judged when three credentials or more are there; everything passes while the others'
    median is under 0.05. It covers what the direction test leaves open: a fragment's first rounds, before that
    test's reference is ready, and a credential that turns against the run on fewer than half of its pushes
    (syncer/defences/agreement.py). Measured (docs/results.md, "Hostile learners"): on honest runs within the noise
    of two runs of one setting, so it is on by default."""
    max_counter_ratio: float = 4.0
    """Ours (0: off). Count a contribution's declared tokens per step as at most this multiple of what other
    credentials' accepted contributions typically declare, and its tokens as at most this multiple of their H
    steps' worth, in its weight, its round's share, its learner's expected contribution and the token budget: its
    weight tokens²/steps is then at most the square of this times an honest full contribution's. A contribution
    whose Δ is zero counts for no tokens and no weight. Honest learners with batches more than this many times
    their peers' are bounded too. Toward the budget, a contribution of more than H steps counts up to this multiple of
    what the others typically train in the time since its learner last pushed the fragment: its skipped cycles were
    trained too."""
    max_round_ratio: float = 10.0
    """Ours (0: off). Drop a round whose merged Δ per step is over this multiple of the median of the fragment's
    recent rounds (from its 4th; a prior from the fragment's norm before), instead of publishing it: its
    contributors get the last good values. A non-finite merge is dropped whatever this is."""
    heartbeat_seconds: float = 0.5
    """How often a learner reports liveness and progress."""
    absent_after_seconds: float = 10.0
    """A learner silent this long is absent: rounds stop waiting for it."""
    forget_after_seconds: float = 86400.0
    """A learner that left, or has been absent, this long is forgotten: its record (where it would resume, its
    counters) is dropped, and the same id joining later starts afresh."""

    @property
    def keeps_outer_state(self) -> bool:
        """Whether the outer momentum (and the delayed-momentum sum) can move Θ: not with μ = 0, decoupled mode's
        default, where Nesterov, delayed or not, is the plain step Θ ← Θ − η·Δ and neither is kept or saved."""
        return self.outer_momentum != 0

    def policy(self) -> PolicyConfig:
        """The settings the round-closing policy reads."""
        return PolicyConfig(self.quorum, self.overlap, self.grace, self.grace_gamma, self.grace_cap_steps,
                            self.grace_expect_steps)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "SyncConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in json.loads(text).items() if k in known})


def for_mode(mode: str, learners: int, preset: str | None = None, **overrides) -> SyncConfig:
    """The settings of a named mode for `learners` learners under a preset (default, or paper: the published algorithm of docs/algorithm.md),
    with explicit overrides (None means unset)."""
    if mode not in MODES or mode == "dp":
        raise ValueError(f"unknown syncer mode {mode!r}; choose decoupled, streaming or diloco (dp runs without a syncer)")
    preset = preset or "default"
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose {' or '.join(PRESETS)}")
    base = {
        # outer η = 1, μ = 0 measured best for K = 1. Rounds stay open for the peers predicted to push within one
        # cycle (H steps), and learners keep their progress meanwhile: equal-speed learners drift many steps apart,
        # and rounds of one contributor cost most of the gap to dp's tokens (benchmarks/LOG.md, "What costs decoupled
        # mode tokens"). Push alignment did not pay off. The synchronous modes keep DiLoCo's published 0.7 / 0.9,
        # as the methods they reproduce
        "decoupled": dict(quorum=1, wait_for_merge=False, codec="int4", outer_lr=1.0, outer_momentum=0.0,
                          keep_overlap=True, grace_expect_steps=float(overrides.get("sync_every") or SyncConfig.sync_every)),
        # the baselines average outer gradients, as the methods they reproduce (RDA is Decoupled DiLoCo's rule)
        "streaming": dict(quorum=learners, wait_for_merge=True, codec="bf16", down_codec="fp32", merge="mean"),
        "diloco": dict(fragments=1, overlap=0, quorum=learners, wait_for_merge=True, codec="fp32", down_codec="fp32",
                       merge="mean"),
    }[mode]
    if preset == "paper":
        base = {**base, **PAPER}
    cfg = replace(SyncConfig(mode=mode, preset=preset), **base)
    cfg = replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    validate(cfg, learners)
    return cfg


def validate(cfg: SyncConfig, learners: int | None = None) -> None:
    check_codec(cfg.codec)
    check_codec(cfg.down_codec)
    if cfg.wire_compression not in WIRE_COMPRESSIONS:
        raise ValueError(f"--wire-compression must be one of {', '.join(WIRE_COMPRESSIONS)}, got {cfg.wire_compression!r}")
    if cfg.publish_to not in ("contributors", "live"):
        raise ValueError(f"--publish-to must be contributors or live, got {cfg.publish_to!r}")
    if cfg.publish_to == "live" and cfg.down_codec != "fp32":
        raise ValueError(f"--publish-to live needs --down-codec fp32 (got {cfg.down_codec}): a learner with a push "
                         f"in flight must not see the values that push is computed from change under it")
    if cfg.repeat_push not in REPEAT_PUSHES:
        raise ValueError(f"--repeat-push must be one of {', '.join(REPEAT_PUSHES)}, got {cfg.repeat_push!r}")
    if cfg.preset not in PRESETS:
        raise ValueError(f"unknown preset {cfg.preset!r}; choose {' or '.join(PRESETS)}")
    if cfg.fragments < 1:
        raise ValueError(f"--fragments must be at least 1, got {cfg.fragments}")
    if cfg.sync_every < 1:
        raise ValueError(f"--sync-every must be at least 1, got {cfg.sync_every}")
    if cfg.overlap < 0 or cfg.overlap >= cfg.sync_every:
        raise ValueError(f"--overlap must be between 0 and --sync-every − 1 ({cfg.sync_every - 1}), got {cfg.overlap}")
    if cfg.quorum < 1:
        raise ValueError(f"--quorum must be at least 1, got {cfg.quorum}")
    if learners is not None and cfg.quorum > learners:
        raise ValueError(f"--quorum {cfg.quorum} is more than the {learners} learners: no round could ever close")
    if cfg.merge not in ("rda", "mean"):
        raise ValueError(f"unknown merge rule {cfg.merge!r}; choose rda or mean")
    if cfg.keep_overlap and cfg.blend > 0:
        raise ValueError("--keep-overlap and --blend are two different apply rules; choose one")
    if not 0.0 <= cfg.blend < 1.0:
        raise ValueError(f"blend α must be in [0, 1), got {cfg.blend}")
    if cfg.max_steps_ratio < 0:
        raise ValueError(f"max steps ratio must be non-negative, got {cfg.max_steps_ratio}")
    if cfg.max_norm_ratio < 0:
        raise ValueError(f"max norm ratio must be non-negative, got {cfg.max_norm_ratio}")
    for name in ("clip_norm_ratio", "max_counter_ratio", "max_round_ratio"):
        value = getattr(cfg, name)
        if not (0 <= value < math.inf) or 0 < value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be 0 (off) or a finite number ≥ 1, got {value}")
    if not 0 <= cfg.direction_floor <= 1:
        raise ValueError(f"--direction-floor must be 0 (off) or in (0, 1], got {cfg.direction_floor}")
    if not 0 <= cfg.agreement_floor <= 1:
        raise ValueError(f"--agreement-floor must be 0 (off) or in (0, 1], got {cfg.agreement_floor}")
    if not 0 <= cfg.norm_ceiling < math.inf:
        raise ValueError(f"norm ceiling must be a non-negative number, got {cfg.norm_ceiling}")
    if cfg.grace_expect_steps < 0:
        raise ValueError(f"--grace-expect-steps must be non-negative, got {cfg.grace_expect_steps}")
    if not cfg.forget_after_seconds > cfg.absent_after_seconds:
        raise ValueError(f"forget_after_seconds ({cfg.forget_after_seconds}) must exceed absent_after_seconds "
                         f"({cfg.absent_after_seconds})")
    if cfg.momentum_every < 1:
        raise ValueError(f"--momentum-every must be at least 1 (1: the momentum advances on every round), "
                         f"got {cfg.momentum_every}")
    if cfg.max_staleness < 0:
        raise ValueError(f"max staleness must be non-negative, got {cfg.max_staleness}")
