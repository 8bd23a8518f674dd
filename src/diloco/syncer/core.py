"""The syncer's state machine: joins, pushes, rounds, merges and outer steps (docs/algorithm.md §4, §7).

No sockets and no clock of its own: the service calls it from one worker thread and passes time in, and tests
drive it directly.

Threads (docs/architecture.md, Threading model): every call that changes rounds, fragments or the set of learners
(initialize, join, snapshot_for_join, push, resync, poll, persist, restore) runs on ONE worker thread. Other threads
may call the readers and the light writers (heartbeat, heartbeat_reply, leave, phase_lead, budget_progress,
tokens_trained, should_stop, live, status) at any time: `lock` guards the ledger and the round bookkeeping they
share. The worker holds it only for bookkeeping; the heavy arithmetic of a round (decoding and folding a
contribution in, merging, the outer step, encoding, checksums, writing to disk) runs without it, on tensors only
the worker touches. Only the worker adds learners, so it may read the ledger without the lock.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable

import torch

from diloco.algorithm import codec
from diloco.config import SyncConfig
from diloco.algorithm.fragments import Fragment, TensorSpec, first_difference, fit_fragments, plan_fragments, segments, signature
from diloco.algorithm.merge import StreamingMerge, segment_norms, token_weight
from diloco.algorithm.policy import MovingAverage
from diloco.algorithm.schedule import leading_position, offset
from diloco.syncer.ledger import LearnerRecord
from diloco.syncer.membership import Membership, Refused, check_learner_id, rejoined
from diloco.syncer.round_timing import RoundTiming
from diloco.syncer import downlink, persistence, phase, repeat_push, rounds
from diloco.syncer.buffers import Buffers
from diloco.syncer.defences import agreement, replayed
from diloco.syncer.defences.direction_guard import DirectionGuard
from diloco.syncer.downlink import Publication
from diloco.syncer.fragment_state import Contribution, FragmentState, fp32_bytes
from diloco.syncer.kept_payloads import KeptPayloads
from diloco.syncer.defences.norm_guard import NormGuard
from diloco.syncer.defences.reference import Counters
from diloco.syncer.at_rest.store import StateStore


RECENT_ROUNDS = 300
REUSED_FRAGMENTS = 1
"""Free buffers kept for reuse, in sizes of the largest fragment: one embedding fragment's worth holds the few
smaller buffers a round of any other fragment needs. 3 (before) held 0.45 F more at GPT-2's peak for pushes that
went no faster (1.08 against 1.06 GB/s through SyncerCore, benchmarks/syncer/throughput.py)."""
log = logging.getLogger("diloco.syncer")
ROUND_LOG_KEPT = 1_000_000  # rounds kept in memory (about 50 MB): days of a fast run


@dataclass(frozen=True)
class PushResult:
    accepted: bool
    reason: str = ""
    duplicate: bool = False
    resync: bool = False


class SyncerCore(Membership, RoundTiming):
    def __init__(self, cfg: SyncConfig, clock: Callable[[], float] = time.monotonic, token_budget: int | None = None,
                 duration: float | None = None, store: StateStore | None = None, shard: tuple[int, int] = (0, 1)):
        """`shard` (i, N): this syncer owns the fragments p with p mod N = i and holds only their state
        (docs/architecture.md, Sharded syncers); (0, 1) owns them all."""
        if not 0 <= shard[0] < shard[1]:
            raise ValueError(f"shard {shard[0]}/{shard[1]}: need 0 ≤ i < N")
        if shard[1] > 1 and cfg.split_tensors:
            raise ValueError("split tensors cannot be sharded: a tensor's pieces would lie in several shards' models")
        self.shard = shard
        self.cfg = cfg
        self.store = store
        self.clock = clock
        self.token_budget = token_budget
        self.duration = duration
        self.training_started_at: float | None = None
        """When a learner first reported trained tokens: where a --duration budget starts."""
        self.specs: list[TensorSpec] | None = None
        self.fragments: list[FragmentState] = []
        self.buffers = Buffers()
        """Decoded pushes and RDA sums, reused (sized by `bound_buffers` once the fragments are known)."""
        self.kept_payloads = KeptPayloads()
        """The agreement test's payloads of open rounds; the server bounds what stays in memory."""
        self.change_buffer: float | None = None  # downlink changes kept, a share of the fp32 fragments (None: all)
        self.learners: dict[str, LearnerRecord] = {}
        self.departed = {"trained": 0, "budget": 0.0, "merged": 0.0}
        """Tokens trained, counted by the budget and merged of the learners forgotten (`expire`)."""
        self.quorum_avg, self.sync_avg = MovingAverage(), MovingAverage()
        self.rounds = 0
        self.dropped_rounds = 0
        """Rounds closed without publishing (non-finite or outsized merged Δ: rounds.unpublishable)."""
        self.started_at = clock()
        self.started_unix = time.time()  # only to line reports up with other processes' logs
        self.round_log: deque[tuple[float, int, int, int]] = deque(maxlen=ROUND_LOG_KEPT)
        """(seconds since start, fragment, version, contributors) of every closed round."""
        self.recent_rounds: deque[tuple[float, int, int, int]] = deque(maxlen=RECENT_ROUNDS)
        """The latest of them, for /status and the dashboard (a copy of all would be costly twice a second)."""
        self.refusals: dict[str, int] = {}
        self.counters = Counters()
        """Declared tokens and tokens per step of accepted parameter contributions, per credential: what a
        contribution's counters are bounded by (`SyncConfig.max_counter_ratio`)."""
        self.stopping = False
        self._outbox: list[Publication] = []
        """Publications of rounds closed outside `poll` (see `push`); the next poll returns them."""
        self.lock = threading.RLock()
        """Guards the ledger and the round bookkeeping against the light calls of other threads (module docstring).
        Held only briefly and never while acquiring anything else."""
        self.merge_stats = {"count": 0, "total": 0.0, "last": 0.0, "max": 0.0}
        """Seconds of closed rounds (merge, outer step, encoding, persisting: `rounds.close`)."""
        self.full_answers = {"count": 0, "bytes": 0}
        """Answers and resyncs sent as full fp32 values (the learner held a version the change window no longer
        reaches), and their payload bytes: each costs the syncer a fragment-sized encoding and the link 4 bytes a
        value."""
        self.tape = None
        """The event tape (syncer/observation/tape.py) rounds, joins, leaves, refusals and expiries are recorded on, if any."""
        self.on_event: Callable[[str, dict], None] | None = None
        """Called with each event the tape records (the service feeds its metrics)."""
        self.on_merge: Callable[[float], None] | None = None
        """Called with each closed round's seconds (the service feeds its metrics)."""

    @property
    def policy(self):
        """The round-closing policy's settings, always those of the current configuration."""
        return self.cfg.policy()

    # ---- model --------------------------------------------------------------------------------------------
    @property
    def initialized(self) -> bool:
        return self.specs is not None

    def owns(self, fragment: int) -> bool:
        return fragment % self.shard[1] == self.shard[0]

    def owner(self, fragment: int) -> str:
        return f"shard {fragment % self.shard[1]} of {self.shard[1]}"

    def initialize(self, specs: list[TensorSpec], flats: list[torch.Tensor], take: bool = False) -> bool:
        """Adopt the first learner's initial parameters as the global model (fragment order, flat fp32; a fragment
        another shard owns may be given as an empty tensor). `take`: the owned values become the global ones without
        a copy (the caller made them for this and keeps no reference it writes to).

        Returns False when another learner's parameters were adopted first (those then win; this one re-joins).
        """
        if self.initialized:
            return False
        fitted = fit_fragments(specs, self.cfg.fragments, self.cfg.split_tensors)
        if fitted != self.cfg.fragments:
            self.cfg = replace(self.cfg, fragments=fitted)
        layout = plan_fragments(specs, self.cfg.fragments, self.cfg.split_tensors)
        if len(flats) != len(layout) or any(f.numel() != fr.numel for f, fr in zip(flats, layout) if self.owns(fr.index)):
            raise Refused("initial parameters do not match the model's fragment layout")
        for fr, f in zip(layout, flats):
            if self.owns(fr.index) and not codec.all_finite(f):
                raise Refused(f"initial values of fragment {fr.index} contain NaN or Inf")
        fragments = [self._state_for(fr, f, take) for fr, f in zip(layout, flats)]
        with self.lock:
            self.specs = list(specs)
            self.fragments = fragments
        self.bound_buffers()
        self.persist([fs.fragment.index for fs in self.owned])
        return True

    def bound_buffers(self) -> None:
        """Keep at most REUSED_FRAGMENTS of the largest owned fragment's size free for reuse."""
        self.buffers.limit_bytes = REUSED_FRAGMENTS * 4 * max((fs.fragment.numel for fs in self.owned), default=0)

    def _state_for(self, fragment: Fragment, flat: torch.Tensor, take: bool = False) -> "FragmentState":
        """A fragment's state from its initial values; empty for one another shard owns."""
        if not self.owns(fragment.index):
            return FragmentState(fragment, torch.zeros(0), torch.zeros(0))
        needed = fragment.role == "params" and self.cfg.keeps_outer_state
        momentum = torch.zeros_like(flat) if needed else torch.zeros(0)
        return FragmentState(fragment, flat if take else flat.clone(), momentum, guard=self.norm_guard(fragment),
                             direction=self.direction_guard(fragment))

    @property
    def owned(self) -> list["FragmentState"]:
        return [fs for fs in self.fragments if self.owns(fs.fragment.index)]

    def norm_guard(self, fragment: Fragment) -> NormGuard | None:
        """The outlier bounds for a parameter fragment (buffers are averaged, not stepped: no bound)."""
        if fragment.role != "params" or not (self.cfg.norm_ceiling or self.cfg.max_norm_ratio or self.cfg.clip_norm_ratio):
            return None
        return NormGuard(fragment.numel, self.cfg.norm_ceiling, self.cfg.max_norm_ratio, self.cfg.sync_every,
                         self.cfg.clip_norm_ratio)

    def direction_guard(self, fragment: Fragment) -> DirectionGuard | None:
        """The direction test for a parameter fragment (`SyncConfig.direction_floor`), None when it is off."""
        if fragment.role != "params" or not self.cfg.direction_floor:
            return None
        return DirectionGuard(fragment.numel, self.cfg.direction_floor)

    def params(self) -> dict[str, torch.Tensor]:
        """The global model as its whole state_dict: every tensor in its own dtype, in model order, an alias (a tied
        head) as a copy of the tensor it shares, so that `load_state_dict(strict=True)` takes it as it is."""
        out: dict[str, torch.Tensor] = {}
        for fs in self.owned:
            offset, theta = 0, fs.outer_values()
            for s in fs.fragment.specs:
                values = theta[offset : offset + s.numel]
                if s.whole:
                    out[s.name] = values.view(s.shape).to(getattr(torch, s.dtype)).clone()
                else:  # a piece: the tensor is whole once every fragment has added its own
                    whole = out.setdefault(s.name, torch.empty(s.shape, dtype=getattr(torch, s.dtype)))
                    whole.view(-1)[s.start : s.stop] = values
                offset += s.numel
        # a shard's model holds its own fragments' tensors (and aliases of them): the shards' files together are
        # the whole state_dict
        return {s.name: out[s.alias_of].clone() if s.kind == "alias" else out[s.name] for s in self.specs or []
                if (s.alias_of if s.kind == "alias" else s.name) in out}

    @property
    def param_fragments(self) -> list["FragmentState"]:
        return [fs for fs in self.fragments if fs.fragment.role == "params"]

    # ---- membership ---------------------------------------------------------------------------------------
    def join(self, learner_id: str, specs: list[TensorSpec], credential: str | None = None, proof: str = "") -> str:
        """Admit a learner whose model matches; returns its new session id. Refused on any mismatch. `credential`:
        the name of the credential it proved (None: a shared run token, and the id stands for itself); `proof`:
        which token of it (`credentials.proof`), so that replacing the token revokes this session."""
        check_learner_id(learner_id)
        if self.stopping:
            raise Refused("the syncer is shutting down; retry against its replacement")
        if not self.initialized:
            raise Refused("not initialised")  # the service turns this into a request for initial parameters
        diff = first_difference(self.specs, specs)
        if diff is not None:
            raise Refused(
                f"model mismatch ({diff}); every learner must build the same model as the run "
                f"(signature {signature(self.specs)}, yours {signature(specs)})"
            )
        session = secrets.token_urlsafe(16)  # 128 bits: the learner's credential for every later RPC
        with self.lock:
            now = self.clock()
            record = self.learners.get(learner_id)
            how = ("joined the run" if record is None else
                   f"rejoined under its id (new session) {rejoined(record, now, self.cfg.absent_after_seconds)}")
            if record is None:
                record = LearnerRecord(learner_id, session, now, now)
                self.learners[learner_id] = record
            # the new session counts from 0: what it trained still counts
            record.tokens_base, record.steps_base = record.tokens_trained, record.step
            record.session, record.joined_at, record.last_seen, record.left, record.left_at = session, now, now, False, None
            record.absent = False
            record.credential = credential or learner_id
            record.proof, record.revoked = proof, False
            record.start_position = self._start_position(learner_id) if self.cfg.wait_for_merge else None
            self.record_event("join", learner=learner_id)
            record.versions, record.finished = {i: fs.version for i, fs in enumerate(self.fragments) if self.owns(i)}, set()
        log.info("learner %s %s", learner_id, how)
        return session

    def _start_position(self, learner_id: str) -> int | None:
        """Where a joiner's push schedule starts in a synchronous mode (1..H): just after the fragment its live
        peers pushed last, so it pushes next what they push next. Rounds already open when it joins do not wait for
        it (`awaited`); every later round waits for a fragment it will push. Started at fragment 0 instead, it
        would wait for a merge its peers never push towards, while they wait for it. The most advanced peer counts,
        not the most recent push: a peer one fragment behind may push after the leader has opened the next round,
        which does not wait for the joiner, and a joiner behind the leader would push that fragment alone, into a
        round its peers reach only a period later. None: no live peer has pushed in its current session (the
        schedule starts at its beginning)."""
        H = self.cfg.sync_every
        positions = [offset(r.last_push[1], H, self.cfg.fragments) % H + 1 for i in self.live() - {learner_id}
                     if (r := self.learners[i]).last_push is not None and r.last_push[0] >= r.joined_at]
        return leading_position(positions, H)

    def snapshot_for_join(self, learner_id: str, copy: bool = True) -> list[tuple[int, int, torch.Tensor]]:
        """(fragment, version, full values P_v) for a joiner, recorded as what it holds. `copy=False` lends the
        values themselves (`FragmentState.lend`): the gRPC join only reads them, and a round closing meanwhile
        changes a copy; an in-process learner, which changes what it holds, needs copies."""
        record = self.learners[learner_id]
        record.versions = {i: fs.version for i, fs in enumerate(self.fragments) if self.owns(i)}
        return [(i, fs.version, fs.values.clone() if copy else fs.lend())
                for i, fs in enumerate(self.fragments) if self.owns(i)]

    # ---- pushes and rounds --------------------------------------------------------------------------------
    def push(
        self, learner_id: str, session: str, seq: int, fragment: int, base_version: int, steps: int, tokens: int,
        payload: codec.Encoded, data_position: int = 0, transfer_seconds: float = 0.0, final: bool = False,
    ) -> PushResult:
        """Admit a contribution and fold it into its round's running sums. Worker thread: decoding and folding run
        without the lock. `final`: the learner's last push of the fragment (its training has ended)."""
        result = self._admit(learner_id, session, seq, fragment, base_version, steps, tokens, payload, data_position,
                             transfer_seconds, final)
        if not result.accepted:
            self.record_event("refusal", learner=learner_id, fragment=fragment, seq=seq, reason=result.reason)
        return result

    @property
    def repeat(self) -> repeat_push.Close:
        """What a push from a learner already in the round does (syncer/repeat_push.py); a restored state may bring
        its own settings."""
        return repeat_push.policy(self.cfg.repeat_push)

    def record_event(self, kind: str, **fields) -> None:
        """One event to the metrics (`on_event`) and the tape, if either is attached."""
        if self.on_event is not None:
            self.on_event(kind, fields)
        if self.tape is not None:
            self.tape.record(kind, clock=round(self.clock() - self.started_at, 6), **fields)

    def _admit(
        self, learner_id: str, session: str, seq: int, fragment: int, base_version: int, steps: int, tokens: int,
        payload: codec.Encoded, data_position: int, transfer_seconds: float, final: bool = False,
    ) -> PushResult:
        with self.lock:
            record = self._record(learner_id, session)
            self._heard(record)
            if 0 <= fragment < len(self.fragments) and not self.owns(fragment):
                return PushResult(False, f"wrong shard: fragment {fragment} is served by {self.owner(fragment)}")
            if seq <= record.merged_before(session, fragment):
                # merged before (perhaps before a restart): its result may have been missed, so send the current values
                return PushResult(True, "duplicate push ignored", duplicate=True, resync=True)
            pending = self.fragments[fragment].pending.get(learner_id) if 0 <= fragment < len(self.fragments) else None
            if pending is not None and (pending.session, pending.seq) == (session, seq):
                return PushResult(True, "duplicate push ignored", duplicate=True)
            if self.repeat.superseded(pending, session, seq):  # syncer/repeat_push.py
                return PushResult(True, "superseded push ignored", duplicate=True)
            arrived = self.clock()
        try:
            delta = self._validate(fragment, steps, tokens, payload)  # decodes: no lock
        except Refused as e:
            # the learner's copy of this fragment is suspect: it gets the current values to start over from
            reason = str(e).split(":")[0]
            with self.lock:
                record.refused += 1
                self.refusals[reason] = self.refusals.get(reason, 0) + 1
            return PushResult(False, str(e), resync=True)
        fs = self.fragments[fragment]
        check = self._close_if_due(fragment, fs, arrived)  # before its version gives this push's staleness
        staleness = fs.version - base_version
        params = fs.fragment.role == "params"
        # the agreement test's summary of Δ as sent, and the payload to fold it in anew if its round scales it down
        judged = params and self.cfg.agreement_floor > 0
        sketch = agreement.sketch(delta) if judged else None
        encoded = payload if judged or self.cfg.merge_at_close else None
        scale = 1.0
        method = self.cfg.merge if params else "mean"
        # one read of Δ gives its norms to the guard and to RDA alike
        norms = segment_norms(delta, segments(fs.fragment)) if fs.guard or method == "rda" else None
        per_step = fs.guard.per_step(math.sqrt(sum(n * n for n in norms)), steps) if fs.guard else 0.0
        fragment_norm = self.fragment_norm(fs) if fs.guard else 0.0
        moving = any(norms) if norms is not None else bool(delta.any())
        checked = self.cfg.refuse_replays and params and moving and payload.numel >= replayed.MIN_VALUES
        digest = replayed.digest(payload.data) if checked else None
        with self.lock:
            credential = record.credential or learner_id
            if staleness < 0 or staleness > self.cfg.max_staleness:
                return self._refuse(record, delta, "stale", f"contribution based on version {base_version} of fragment "
                                    f"{fragment} which is at {fs.version}: fetch the current fragment")
            if digest is not None and digest in fs.replays:
                return self._refuse(record, delta, "replayed", f"replayed: the payload repeats, byte for byte, one "
                                    f"already accepted for fragment {fragment}; a push carries new progress")
            outlier = fs.guard.judge(credential, per_step, fragment_norm) if fs.guard else None
            if outlier is not None:
                return self._refuse(record, delta, outlier.split(":")[0], f"{outlier} of fragment {fragment}")
            bound = fs.guard.clip_bound(credential, fragment_norm) if fs.guard else None
            # with repeat_push replace, a push from a learner already in the round takes its place: counted for its
            # own counters plus those of the replaced push they do not cover (rounds.earlier_counters), bounded below
            # like any push's; the guard and the clip above judged this push's Δ by its own steps alone
            older = self.repeat.replaced(fs, learner_id)
            earlier = rounds.earlier_counters(older, session, base_version, steps, tokens) if older else (0, 0)
            steps, tokens = steps + earlier[0], tokens + earlier[1]
            declared = counted = rounds.counted_as(tokens, steps, self.cfg)
            carried = float(tokens)
            free_ride = bool(self.cfg.max_counter_ratio and norms is not None and not any(norms))
            if free_ride:  # no progress at all, whatever it claims: it counts for no tokens and has no weight
                counted, carried = (0.0, counted[1]), 0.0
            since = max(record.pushed_at.get(fragment, record.joined_at), record.joined_at)
            if params and not free_ride:
                ratio, H = self.cfg.max_counter_ratio, self.cfg.sync_every
                counted = self.counters.plausible(credential, *counted, ratio, H)
                carried = self.counters.plausible(credential, tokens, steps, ratio, H)[0]
                if carried < tokens:  # longer than H steps: as much as it had time to train since it last pushed it
                    carried = max(carried, self.counters.in_time(credential, tokens, arrived - since, ratio))
        if bound is not None and per_step > bound:
            # the robust merge: merged at the typical size of other parties' steps, not refused
            factor = bound / per_step
            delta.mul_(factor)
            scale *= factor
            norms, per_step, payload = [n * factor for n in norms], bound, None
        direction, cosine = 1.0, None
        if fs.direction is not None:
            # the direction test: Δ against the fragment's recent steps, merged scaled down with its weight when it
            # goes elsewhere (syncer/defences/direction_guard.py); the norm bounds above keep its size as sent
            norm = math.sqrt(sum(n * n for n in norms)) if norms is not None else torch.linalg.vector_norm(delta).item()
            cosine = fs.direction.cosine(delta, norm)
            with self.lock:
                direction = fs.direction.judge(credential, cosine)
            if direction < 1.0:
                delta.mul_(direction)
                scale *= direction
                norms, payload = None if norms is None else [n * direction for n in norms], None
        with self.lock:
            if fs.guard:
                fs.guard.accept(credential, per_step)
            if params and not free_ride:
                self.counters.accept(credential, *counted)
                if fragment in record.pushed_at and record.pushed_at[fragment] >= record.joined_at:
                    self.counters.accept_rate(credential, carried, arrived - record.pushed_at[fragment])
                record.pushed_at[fragment] = arrived
                if digest is not None:
                    fs.replays.add(digest)
                # every token trains every fragment: a shard counts its own fragments' share of each; a replacement
                # adds only what the push it replaces did not
                added = max(0.0, carried - (older.carried if older else 0.0))
                record.tokens_accepted += added / max(1, sum(1 for f in self.owned if f.fragment.role == "params"))
                self._back_claims(record, credential, arrived)
                record.last_push = (arrived, fragment)  # its phase in the push schedule, for predicting the next
                record.step_tokens = counted[0] / counted[1] if counted[1] else 0.0
            record.pushes += 1
            record.staleness = staleness
            if transfer_seconds:
                self.sync_avg.update(transfer_seconds)
            repeated = learner_id in fs.pending
        if repeated and older is None:
            # repeat_push close: its earlier contribution, already folded into the sums, is merged in a round of its
            # own (no Δ is kept to take it out again; docs/architecture.md, Syncer memory)
            self._outbox.extend(rounds.close(self, fragment, fs, {"reason": "repeat"}))
        c = Contribution(learner_id, session, seq, base_version, steps, tokens, data_position, arrived, counted,
                         bounded=counted != declared, earlier=earlier,
                         carried=max(carried if params and not free_ride else 0.0, older.carried if older else 0.0))
        c.check, c.final = check, final
        if older is not None:
            c.replaced = older.replaced + 1
            c.since = older.since if older.since is not None else older.arrived_at
            self.record_event("replaced", learner=learner_id, fragment=fragment, seq=seq, replaced_seq=older.seq,
                              counters="own" if earlier == (0, 0) else "sum", steps=steps, tokens=tokens)
        if fs.merging is None:
            fs.merging = StreamingMerge(segments(fs.fragment), method, self.buffers, self.cfg.rda_mean_fallback)
        # the version cannot change while the round is open, so the weight is the one the round closes with
        c.direction, c.cosine = direction, cosine
        weight = token_weight(*counted, fs.version - base_version, self.cfg.staleness_decay) * direction
        if encoded is not None:  # in memory up to its budget, beyond it on disk (syncer/kept_payloads.py)
            encoded = self.kept_payloads.keep(fragment, encoded, fp32_bytes(self.owned),
                                              replacing=older.encoded if older is not None else None)
        c.sketch, c.encoded, c.scale, c.weight, c.norms = sketch, encoded, scale, weight, norms
        if self.cfg.merge_at_close:  # folded in from its kept payload when the round closes (rounds.close)
            self.buffers.give(delta)
            with self.lock:
                self._pending(fragment, fs, c, arrived)
            return PushResult(True)
        try:
            self.repeat.fold(self.buffers, fs, method, learner_id, delta, weight, norms, payload, older is not None)
        except (ArithmeticError, RuntimeError, ValueError) as e:
            # the sums may be half updated: the round is dropped when it closes (rounds.close), never published
            fs.merging.failed = f"{type(e).__name__}: {e}"
            with self.lock:
                fs.pending[learner_id] = c
            return PushResult(False, f"merge error: {fs.merging.failed}; its round is dropped", resync=True)
        with self.lock:
            self._pending(fragment, fs, c, arrived)
        return PushResult(True)

    def _pending(self, fragment: int, fs: FragmentState, c: Contribution, arrived: float) -> None:
        """`c` joins the open round of `fragment` (under the lock)."""
        fs.pending[c.learner] = c
        if c.final:  # its training ended: from now on it reads no result, however long its own rounds stay open
            downlink.finished(self.learners[c.learner], fragment, True, self.fragments, self.owns)
        if fs.opened_at is None:
            fs.opened_at = arrived  # when its first push arrived, not when that push was decoded: see `awaited`
        if fs.quorum_at is None:  # reached when the push that makes it arrives, however late the next poll
            avg = self.averages()
            self._note_quorum(fs, *self._decide(fragment, fs, self.live(), avg, arrived), avg)

    def _back_claims(self, record: LearnerRecord, credential: str, arrived: float) -> None:
        """An accepted push vouches for what `record`'s heartbeats claim it trained (`tokens_backed`), when declared
        counters are bounded at most 4× (`max_counter_ratio`) what the others typically train in the time since its
        previous accepted push (`Counters.in_time`). Under the lock."""
        claimed, ratio = float(record.tokens_trained), self.cfg.max_counter_ratio
        if ratio and record.backed_at is not None:
            claimed = min(claimed, record.tokens_backed + self.counters.in_time(
                credential, max(0.0, claimed - record.tokens_backed), arrived - record.backed_at, ratio))
        elif ratio:  # its first push: what its own counters carried is all it vouches for
            claimed = min(claimed, record.tokens_accepted)
        record.tokens_backed, record.backed_at = max(record.tokens_backed, claimed), arrived

    def _refuse(self, record: LearnerRecord, delta: torch.Tensor, reason: str, message: str) -> PushResult:
        """Refuse a decoded contribution (the lock held): its buffer back, the refusal counted, a resync."""
        self.buffers.give(delta)
        record.refused += 1
        self.refusals[reason] = self.refusals.get(reason, 0) + 1
        return PushResult(False, message, resync=True)

    def _validate(self, fragment: int, steps: int, tokens: int, payload: codec.Encoded) -> torch.Tensor:
        if not self.initialized:
            raise Refused("not initialised: join first")
        if not 0 <= fragment < len(self.fragments):
            raise Refused(f"bad fragment: {fragment} is not in 0..{len(self.fragments) - 1}")
        role = self.fragments[fragment].fragment.role
        if role == "static" or (role == "buffers" and not self.cfg.sync_buffers):
            raise Refused(f"bad fragment: {fragment} holds tensors that are set on join and never pushed")
        expected = self.fragments[fragment].fragment.numel
        if payload.numel != expected:
            raise Refused(f"bad shape: fragment {fragment} has {expected} values, payload has {payload.numel}")
        if steps < 1 or tokens < 0:
            raise Refused(f"bad counters: steps={steps} tokens={tokens}")
        if self.cfg.max_steps_ratio and steps > self.cfg.max_steps_ratio * self.cfg.sync_every:
            raise Refused(f"too long unsynchronised: {steps} local steps since the last merge of fragment {fragment} "
                          f"(limit {self.cfg.max_steps_ratio:g}·H); start over from the current values")
        delta = self.buffers.take(expected)
        try:
            codec.decode(payload, delta)
        except (codec.CorruptPayload, ValueError) as e:
            self.buffers.give(delta)
            raise Refused(f"corrupt payload: {e}") from None
        if not codec.finite(payload, delta):
            self.buffers.give(delta)
            raise Refused("non-finite values: the outer gradient contains NaN or Inf")
        return delta

    def fragment_norm(self, fs: FragmentState) -> float:
        """‖P_v‖ of the fragment's current version (core worker: rounds change it only there)."""
        if fs.norm_at is None or fs.norm_at[0] != fs.version:
            fs.norm_at = (fs.version, fs.values.norm().item())
        return fs.norm_at[1]

    def payload_limit(self, fragment: int, codec_name: str) -> int:
        """Bytes a push of `fragment` may carry: the service refuses larger streams before buffering them."""
        if not self.initialized or not 0 <= fragment < len(self.fragments) or not self.owns(fragment):
            return 0
        return codec.encoded_size(self.fragments[fragment].fragment.numel, codec.check_codec(codec_name))

    def resync(self, learner_id: str, session: str, fragment: int, seq: int = 0) -> Publication:
        """The current full fragment for a learner told to fetch it, as the answer to its push `seq`."""
        record = self._record(learner_id, session)
        fs = self.fragments[fragment]
        record.versions[fragment] = fs.version
        pub = Publication(learner_id, fragment, fs.version, codec.encode(fs.values, "fp32"), True,
                          downlink.checksum(fs), seq)
        with self.lock:
            downlink.count_full(self.full_answers, [pub])
        return pub

    def phase_lead(self, learner_id: str) -> float | None:
        """Steps by which this learner's push schedule runs ahead of its reference's (negative: behind); see
        phase.phase_lead. Learners that follow the reference push each fragment together, so rounds fill."""
        with self.lock:
            return self._phase_lead(learner_id)

    def _phase_lead(self, learner_id: str) -> float | None:
        record = self.learners.get(learner_id)
        if record is None:
            return None
        now, after = self.clock(), self.cfg.absent_after_seconds  # the live peers (`live`), in one pass
        peers = (r for r in self.learners.values() if r is not record and not r.left and now - r.last_seen <= after)
        return phase.phase_lead(record, peers, now, self.cfg.sync_every, self.cfg.fragments)

    # ---- durability ---------------------------------------------------------------------------------------
    def persist(self, changed) -> None:
        """Write the ledger and the `changed` fragments to the store (no-op without one)."""
        persistence.persist(self, changed)

    def restore(self) -> bool:
        """Resume from the store's newest consistent state; False when it holds none."""
        return persistence.restore(self)

    # ---- reporting ----------------------------------------------------------------------------------------
    def status(self) -> dict:
        """What /status shows. Any thread: never waits for a merge."""
        with self.lock:
            now = self.clock()
            return {
                "mode": self.cfg.mode,
                "shard": list(self.shard),
                "owned_fragments": [i for i in range(len(self.fragments)) if self.owns(i)],
                "uptime_seconds": round(now - self.started_at, 3),
                "started_unix": self.started_unix,
                "initialized": self.initialized,
                "rounds": self.rounds,
                "dropped_rounds": self.dropped_rounds,
                "versions": [fs.version for fs in self.fragments],
                "pending": [len(fs.pending) for fs in self.fragments],
                # what accepted pushes back; heartbeats' counts alone are claims (a hostile one may say anything)
                "tokens_trained": self.budget_tokens(),
                "tokens_claimed": self.tokens_trained(),
                "tokens_merged": self.tokens_merged(),
                "token_budget": self.token_budget,
                "stopping": self.should_stop(),
                "averages": vars(self.averages()),
                "refusals": dict(self.refusals),
                "merge_seconds": dict(self.merge_stats),
                "full_answers": dict(self.full_answers),
                "learners": [r.summary(now, self.cfg.absent_after_seconds, self._budget_tokens(r))
                             for r in self.learners.values()],
                "recent_rounds": list(self.recent_rounds),
                "budget_progress": self.budget_progress(),
            }
