"""Closing a round of one fragment: the merged Δ, the outer step, the ledger's bookkeeping, the durable write and
the publications (docs/algorithm.md §4), and how much each contribution counts in weights and shares."""

from __future__ import annotations

import logging
import math
import statistics
import time

import torch

from diloco.algorithm import codec
from diloco.config import SyncConfig
from diloco.algorithm.merge import StreamingMerge, segment_norms, token_weight
from diloco.algorithm.outer import outer_update
from diloco.syncer import downlink
from diloco.syncer.downlink import Publication
from diloco.syncer.defences import agreement
from diloco.syncer.fragment_state import fp32_bytes
from diloco.syncer.defences.norm_guard import MIN_SAMPLES, PRIOR_PER_STEP, fragment_scale

log = logging.getLogger("diloco.syncer")


def counted_as(tokens: int, steps: int, cfg: SyncConfig) -> tuple[float, float]:
    """(tokens, steps) a contribution counts for in weights and shares: at most H steps' worth unless
    `clamp_long_contributions` is off. A learner cut off for long returns with many steps of progress from an old
    base; counted in full, each such contribution would take most of a round's share, and together they would
    overshoot the average."""
    if steps <= cfg.sync_every or not cfg.clamp_long_contributions:
        return float(tokens), float(steps)
    return tokens * cfg.sync_every / steps, float(cfg.sync_every)


def earlier_counters(older, session: str, base_version: int, steps: int, tokens: int) -> tuple[int, int]:
    """(steps, tokens) of a pending contribution `older` that a newer push of the same learner, replacing it
    (`SyncConfig.repeat_push` replace), does not cover: the newer one counts for its own counters plus these.

    A learner's counters run from its last apply, like its Δ = base − θ. A newer push from the same session and base
    version whose counters are at least those of the push it replaces covers that push's progress: nothing is added
    (summing would count it twice). Otherwise (another session, another base, smaller counters) the learner began
    counting again and the older counters are kept beside the newer ones: the sum of docs/algorithm.md §4. Either way
    the total is then bounded like any push's (`counted_as`, `Counters.plausible`)."""
    own_steps, own_tokens = older.steps - older.earlier[0], older.tokens - older.earlier[1]
    if (session, base_version) == (older.session, older.base_version) and steps >= own_steps and tokens >= own_tokens:
        return older.earlier
    return older.steps, older.tokens


def release_kept(core, fs) -> None:
    """A closed round's kept Δs (`FragmentState.kept`) back to the core's buffers."""
    for delta, _, _ in fs.kept.values():
        core.buffers.give(delta)
    fs.kept = {}


def agreement_factors(core, fs, contributions: list) -> list[float]:
    """The agreement test on a closing round (syncer/defences/agreement.py): each contribution's factor, judged
    against the round's other contributions and the last rounds'. Worker thread."""
    credentials = [core.learners[c.learner].credential or c.learner for c in contributions]
    sketches = [c.sketch for c in contributions]
    # the last rounds' contributions of other credentials are others to agree with too: a round of one or two is
    # judged against them
    peers = [(credential, sketch) for credential, (_, sketch) in fs.agreement_peers.items()
             if credential not in credentials]
    verdicts = agreement.judge(credentials + [p[0] for p in peers], sketches + [p[1] for p in peers],
                               core.cfg.agreement_floor, judged=len(contributions))
    fs.agreement_peers.update((credential, (fs.version, s)) for credential, s in zip(credentials, sketches)
                              if s is not None)
    oldest = fs.version - agreement.PEER_ROUNDS + 1
    fs.agreement_peers = {k: v for k, v in fs.agreement_peers.items() if v[0] >= oldest}
    for c, (factor, score) in zip(contributions, verdicts):
        c.agreement, c.agreement_score, c.sketch = factor, score, None
    return [factor for factor, _ in verdicts]


def refold(core, fs, contributions: list, factors: list[float], merging: StreamingMerge, method: str) -> StreamingMerge:
    """The round's sums made anew from its contributions' kept payloads, each scaled by its factor: when the
    agreement test scales one down, and every round with `merge_at_close`. One contribution is decoded at a time, so
    this holds the sums and one fragment-sized buffer. Worker thread."""
    again = StreamingMerge(merging.segments, method, core.buffers, merging.mean_fallback)
    core.buffers.give(merging.sum)
    core.buffers.give(merging.units)
    for c, factor in zip(contributions, factors):
        if c.weight * factor <= 0 and again.base > 0:
            continue  # folded in with no weight: nothing
        delta = core.buffers.take(fs.fragment.numel)
        try:
            payload = core.kept_payloads.load(c.encoded)
            codec.decode(payload, delta)
        except (codec.CorruptPayload, OSError) as e:  # a kept payload the disk gave back damaged: no exact sums
            core.buffers.give(delta)
            again.failed = f"a kept payload of {c.learner} could not be read back: {e}"
            return again
        scaled = c.scale * factor != 1.0
        if scaled:
            delta.mul_(c.scale * factor)
        # folded in as a push is (SyncerCore._admit): its norms, and its payload while it is Δ as sent, so that a round
        # merged at close adds in the same order and the same way as running sums do
        norms = None if c.norms is None else [n * factor for n in c.norms]
        if norms is None and any(again.rda):
            norms = segment_norms(delta, again.segments)
        try:
            again.add(delta, c.weight * factor, norms, None if scaled else payload)
        except (ArithmeticError, RuntimeError, ValueError) as e:  # as a push's fold: the round is dropped
            again.failed = f"{type(e).__name__}: {e}"
        if again.sum is not delta:
            core.buffers.give(delta)
        if again.failed is not None:
            return again
    return again


def close(core, index: int, fs, decision: dict | None = None) -> list[Publication]:
    """Merge the round of fragment `index` of `core` (a SyncerCore), take the outer step, persist, and return the
    publications; `decision` (what the policy decided on) goes on the tape. Worker thread, called without the
    lock: it takes it only for the bookkeeping; the arithmetic touches tensors only the worker does."""
    started = time.monotonic()
    clock_started = core.clock()
    params = fs.fragment.role == "params"
    with core.lock:
        contributions = list(fs.pending.values())
        opened_at, quorum_at = fs.opened_at, fs.quorum_at
        counted = [c.counted or counted_as(c.tokens, c.steps, core.cfg) for c in contributions]
        share = (round_share(core, fs, contributions, [t for t, _ in counted])
                 if core.cfg.scale_partial_rounds and params else 1.0)
    merging, fs.merging = fs.merging, None
    release_kept(core, fs)
    # ---- the arithmetic, without the lock
    if merging.failed is None:
        factors = ([1.0] * len(contributions) if not (params and core.cfg.agreement_floor)
                   else agreement_factors(core, fs, contributions))
        if core.cfg.merge_at_close or any(f != 1.0 for f in factors):
            merging = refold(core, fs, contributions, factors, merging, core.cfg.merge if params else "mean")
    delta = merging.result() if merging.failed is None else None
    vanished = merging.vanished
    steps = sum(s for _, s in counted) / len(counted)
    refused = unpublishable(core, fs, delta, merging.failed, steps, params)
    if refused is not None:
        if delta is not None:
            core.buffers.give(delta)
        return drop(core, index, fs, contributions, refused, decision)
    fs.reclaim()  # joins streaming the current values keep them as they are
    lossy = core.cfg.down_codec != "fp32"
    if lossy and fs.published is None and core.cfg.bf16_residual:  # P was Θ: from here Θ is P + a bf16 residual
        fs.published, fs.theta = fs.theta, None
        fs.residual = torch.zeros(fs.published.numel(), dtype=torch.bfloat16)
    elif lossy and fs.published is None:
        fs.published = fs.theta.clone()  # P was Θ until now: the first lossy change is taken from it
    merged_step = torch.linalg.vector_norm(delta).item() / max(steps, 1.0) if params else 0.0
    if merged_step > 0:  # a frozen phase's zero rounds would make any later step look outsized
        fs.round_steps.append(merged_step)
    if share < 1.0:
        delta.mul_(share)
    if fs.direction is not None and merged_step > 0:
        # the step this round takes: the direction test's reference (and by whose contributions it was formed)
        fs.direction.published(delta, {core.learners[c.learner].credential or c.learner for c in contributions})
    pending_share = fs.pending_share
    # buffers take their token-weighted mean, Θ − mean(Θ_base − b_m), with no outer optimizer; with μ = 0
    # Nesterov, delayed or not, is Θ ← Θ − η·Δ. Learners' last pushes after training ended (`final`) take no
    # momentum step: each finishing learner makes rounds of its own, and a look-ahead in each extrapolated the run's
    # past direction again at its very end
    final = params and all(c.final for c in contributions)
    if (not params or not core.cfg.keeps_outer_state) and fs.residual is not None:
        # Θ = P + residual − η·Δ, made in the round's sum: no fragment-sized temporary beside it
        theta = delta.mul_(-(core.cfg.outer_lr if params else 1.0)).add_(fs.published).add_(fs.residual)
    elif not params:
        theta = fs.outer_values()
        theta.sub_(delta)
    else:
        theta = fs.outer_values()  # the kept tensor, or P + residual made for this round
        if core.cfg.keeps_outer_state and fs.pending_delta is None and (core.cfg.delayed_momentum
                                                                       or core.cfg.momentum_every > 1):
            fs.pending_delta = torch.zeros_like(theta)
        pending_share = outer_update(theta, delta, core.cfg, fs.momentum, fs.pending_delta, share, fs.pending_share,
                                     final)
    version = fs.version + 1
    if lossy:
        downlink.publish_change(fs, version, core.cfg.down_codec, theta)
    core.buffers.give(delta)  # the round's sum (and Θ made in it), used by nothing any more
    del delta, merging, theta
    core.kept_payloads.release(index)  # the agreement test has read what it needed
    # ---- the bookkeeping, under the lock
    with core.lock:
        fs.pending_share = pending_share
        fs.version = version
        fs.pending, fs.opened_at, fs.quorum_at, fs.at_quorum = {}, None, None, None
        core.rounds += 1
        for c, (tokens, _) in zip(contributions, counted):
            record = core.learners[c.learner]
            key = f"{c.session}:{index}"
            record.merged_seq[key] = max(c.seq, record.merged_seq.get(key, 0))
            if not params:
                continue
            record.contribution_tokens.update(tokens)
            record.merged += 1
            record.tokens_merged += c.tokens / core.cfg.fragments
            record.data_position = max(record.data_position, c.data_position)  # where merged work ended
        entry = (round(core.clock() - core.started_at, 4), index, fs.version, len(contributions))
        core.round_log.append(entry)
        now = core.clock()
        core.record_event("round", fragment=index, version=fs.version, share=round(share, 6),
                    open_seconds=None if opened_at is None else round(now - opened_at, 6),
                    quorum_seconds=None if opened_at is None or quorum_at is None else round(quorum_at - opened_at, 6),
                    decision=decision, **({"rda_vanished": vanished} if vanished else {}),
                    contributors=[{"learner": c.learner, "steps": c.steps, "tokens": c.tokens,
                                   "at": None if c.arrived_at is None else round(c.arrived_at - core.started_at, 6),
                                   "staleness": fs.version - 1 - c.base_version,
                                   "counted": [round(x, 6) for x in counted_c],
                                   **({"bounded": True} if c.bounded else {}),
                                   **({"final": True} if c.final else {}),
                                   # in for `replaced` earlier pushes of its learner since `since`: it alone counts
                                   **({"replaced": c.replaced, "since": round(c.since - core.started_at, 6)}
                                      if c.replaced and c.since is not None else {}),
                                   # the direction test: the cosine it measured, and the factor when below 1
                                   **({"cosine": round(c.cosine, 4)} if c.cosine is not None else {}),
                                   **({"direction": c.direction} if c.direction < 1.0 else {}),
                                   # the agreement test: its score in the round, and the factor when below 1
                                   **({"agreement_score": round(c.agreement_score, 4)}
                                      if c.agreement_score is not None else {}),
                                   **({"agreement": c.agreement} if c.agreement < 1.0 else {}),
                                   "weight": c.direction * c.agreement * token_weight(*counted_c, fs.version - 1 - c.base_version,
                                                          core.cfg.staleness_decay),
                                   **checked(c, fs.version - 1, decision)}
                                  for c, counted_c in zip(contributions, counted)])
        core.recent_rounds.append(entry)
    # ---- disk and encoding, without the lock (only the worker adds learners or changes fragments)
    if core.store is not None:
        core.store.append_round(entry)
    core.persist([index])  # durable before it is published
    full: list[codec.Encoded] = []  # P_v in fp32, encoded at most once per round
    answered = current_sessions(core, contributions)
    for c in answered:
        downlink.finished(core.learners[c.learner], index, c.final, core.fragments, core.owns)
    out = [pub for c in answered if not c.final
           for pub in downlink.publications(core.learners[c.learner], index, fs, c.seq, full)]
    if core.cfg.publish_to == "live":  # docs/algorithm.md §4: to every live learner, unasked (seq 0) where it
        # did not push and still trains the fragment
        others = sorted(lid for lid in core.live() - {c.learner for c in answered}
                        if index not in core.learners[lid].finished)
        out += [pub for lid in others for pub in downlink.publications(core.learners[lid], index, fs, 0, full)]
    if lossy:
        with core.lock:
            held = [v for i in core.live() if (v := downlink.held(core.learners[i], index, fs)) is not None]
        downlink.forget_held(fs, held)
        if core.change_buffer is not None:  # after this round's answers took what they need
            downlink.bound_changes(core.owned, core.change_buffer * fp32_bytes(core.owned))
    seconds = time.monotonic() - started
    with core.lock:
        downlink.count_full(core.full_answers, out)
        core.sync_avg.update(core.clock() - clock_started)
        stats = core.merge_stats
        stats["count"] += 1
        stats["total"] += seconds
        stats["last"] = seconds
        stats["max"] = max(stats["max"], seconds)
    if core.on_merge is not None:
        core.on_merge(seconds)
    return out


def checked(c, version: int, decision: dict | None) -> dict:
    """The tape's record of what the policy decided on when it let contribution `c` into the round of `version`
    (`SyncerCore._close_if_due`): `present` (how many of the round's contributors, in order, were in it then), the
    learners it awaited (only when they differ from those at the close), the moving averages and the predicted
    pushes. `diloco replay` asks the policy again with them (syncer/replay.py). Empty for a round's first push."""
    if c.check is None or c.check[0] != version:  # the first of a round, or checked against one closed since
        return {}
    check = dict(c.check[1])
    if decision is not None and check["live"] == decision.get("live"):
        del check["live"]
    return {"check": check}


def round_share(core, fs, contributions: list, counted: list[float]) -> float:
    """Tokens in this round over those plus what each learner missing from it typically brings: the live learners,
    and those that left while this round's progress was being made. The last pushes of a learner that left were
    merged beside progress of the others made at the same time, so that progress is not the whole run's: taken
    as a full step, the last learner to finish a run would add its final steps at M times their weight."""
    tokens = sum(counted)
    if tokens <= 0:
        return 1.0
    present = {c.learner for c in contributions}
    fallback = tokens / len(contributions)
    expected = core.awaited(fs, core.live()) | left_during(core, contributions)
    # a learner's typical contribution counts for at most max_counter_ratio of this round's: one that declared
    # huge counters once cannot shrink every other round's step while it stays away
    cap = core.cfg.max_counter_ratio * fallback if core.cfg.max_counter_ratio else math.inf
    missing = sum(min(core.learners[i].contribution_tokens.value or fallback, cap) for i in expected - present)
    return tokens / (tokens + missing)


def left_during(core, contributions: list) -> set[str]:
    """Learners that left the run after the earliest progress in `contributions` began (a contribution of s steps
    that arrived at t began about s of its learner's step times before t). Call with the core's lock held."""
    starts = [c.arrived_at - c.steps * (core.learners[c.learner].step_time.value or 0.0)
              for c in contributions if c.arrived_at is not None]  # None: restored after a restart
    if not starts:
        return set()
    return {r.id for r in core.learners.values() if r.left_at is not None and r.left_at > min(starts)}


def unpublishable(core, fs, delta: torch.Tensor | None, failed: str | None, steps: float, params: bool) -> str | None:
    """Why a round's merged Δ must not be published (None: it may): its merge failed, it is not finite, or its
    norm per step is over `max_round_ratio` × the median of the fragment's recent rounds (a prior from the
    fragment's own norm before MIN_SAMPLES of them)."""
    if failed is not None:
        return f"merge failed ({failed})"
    if not codec.all_finite(delta):
        return "the merged outer gradient is not finite"
    ratio = core.cfg.max_round_ratio
    if not ratio or not params:  # buffers are averaged values, not steps
        return None
    per_step = torch.linalg.vector_norm(delta).item() / max(steps, 1.0)
    if len(fs.round_steps) >= MIN_SAMPLES:
        typical, of = statistics.median(fs.round_steps), "the median of its recent rounds"
    else:
        typical = PRIOR_PER_STEP * fragment_scale(fs.fragment.numel, core.fragment_norm(fs))
        of = "a typical step for its size"
    if per_step > ratio * typical:
        return f"merged step {per_step:.3g} per step is over {ratio:g}× {of} ({typical:.3g})"
    return None


def drop(core, index: int, fs, contributions: list, reason: str, decision: dict | None) -> list[Publication]:
    """Close a round without publishing it: Θ, the outer state and the version stay as they were, the
    contributions count as merged (re-sends are duplicates) but add no tokens, and each contributor is sent what
    takes it to the last good values."""
    release_kept(core, fs)
    core.kept_payloads.release(index)
    with core.lock:
        fs.pending, fs.opened_at, fs.quorum_at, fs.at_quorum = {}, None, None, None
        for c in contributions:
            key = f"{c.session}:{index}"
            record = core.learners[c.learner]
            record.merged_seq[key] = max(c.seq, record.merged_seq.get(key, 0))
        core.dropped_rounds += 1
        log.warning("dropped round of fragment %d (version %d stays published): %s", index, fs.version, reason)
        core.record_event("dropped", fragment=index, version=fs.version, reason=reason, decision=decision,
                          contributors=[c.learner for c in contributions])
    full: list[codec.Encoded] = []
    return [pub for c in current_sessions(core, contributions)
            for pub in downlink.publications(core.learners[c.learner], index, fs, c.seq, full)]


def current_sessions(core, contributions: list) -> list:
    """The contributions whose learner is still in the session that pushed them. A learner that re-joined under its
    id since took the fragment's full values at the join: an answer to its old session's push would be a change
    from values it no longer holds, and would move what the syncer records it holds."""
    return [c for c in contributions if core.learners[c.learner].check_session(c.session)]
