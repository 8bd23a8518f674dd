"""Decoupled DiLoCo on one device, fast enough for GPU minutes: M learners and the syncer's rounds with every step
of the algorithm (Δ, the codecs, the merge, the outer step, the downlink) on the device, and nothing per step that
waits for it.

The math is the package's own, not a copy: `schedule.due` says when a fragment is pushed, `codec.round_trip` gives
bitwise what a receiver decodes, `merge.merge` is the reference merge (the syncer's streaming merge equals it up to
float rounding), `rounds.counted_as` and `merge.token_weight` weigh contributions, `outer.outer_update` is the
syncer's outer step, and the downlink sends Θ's change through the down codec as `downlink.publish_change` does.
What this leaves out, so that a quality run measures the algorithm and not the network:
- rounds close at the end of the turn (every learner's step, or its share of steps at a lower speed) in which they
  got their first push, with every push of that turn: at equal speeds every learner is in every round, as the
  in-process syncer makes them with the predicted-push window; at mixed speeds, K = 1 with no grace window;
- the defences against hostile learners (norm guards, clip, counter bounds, the direction test): learners are honest;
- a round's share of the expected tokens counts a missing learner at H steps of its last tokens per step.
`tests/bench/test_device_rounds.py` checks it on CPU against the in-process syncer and the Learner to float tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diloco.algorithm import codec
from diloco.config import SyncConfig
from diloco.algorithm.fragments import named_state, plan_fragments, segments, tensor_specs
from diloco.algorithm.merge import merge, token_weight
from diloco.algorithm.outer import outer_update
from diloco.algorithm.schedule import due
from diloco.syncer.rounds import counted_as


HONEST_LEARNERS = dict(clip_norm_ratio=0.0, norm_ceiling=0.0, max_norm_ratio=0.0, max_counter_ratio=0.0,
                       max_round_ratio=0.0, direction_floor=0.0)
"""The defences against hostile learners off: device rounds leave them out (honest learners)."""


@dataclass
class Slot:
    """One learner's view of one fragment."""

    base: torch.Tensor
    """P_v this learner holds (fp32, flat)."""
    version: int = 0
    steps: int = 0
    tokens: int = 0
    pushed_at: int | None = None
    kept: torch.Tensor | None = None
    """To keep the steps taken since the push (`keep_overlap`): Δ in bf16 where the learner stages it so (an int4
    push from a CPU model), else θ at the push."""
    ready: tuple[torch.Tensor, int, torch.Tensor | None] | None = None
    """(P_v, v, the change from the learner's P_{v−1} when the downlink sends changes) answering the push, applied
    `overlap` steps after it."""


@dataclass
class Push:
    learner: int
    delta: torch.Tensor
    counted: tuple[float, float]
    base_version: int
    final: bool


class Global:
    """The syncer's state of one fragment: Θ (or P + a bf16 residual), the outer state, the version."""

    def __init__(self, values: torch.Tensor, cfg: SyncConfig):
        self.theta, self.published, self.residual = values.clone(), None, None
        self.momentum = torch.zeros_like(values) if cfg.keeps_outer_state else None
        self.pending = torch.zeros_like(values) if cfg.keeps_outer_state else None
        self.pending_share, self.version = 0.0, 0

    @property
    def values(self) -> torch.Tensor:
        """P_v, what learners hold."""
        return self.theta if self.published is None else self.published

    def outer_values(self) -> torch.Tensor:
        return self.theta if self.residual is None else self.published + self.residual.float()


class DeviceRounds:
    """The learners' fragment bookkeeping and the syncer's rounds for `models` (each a replica of one model, on one
    device), under `cfg`. Call `stepped(m, tokens)` after learner m's optimizer step, `end_turn()` after every
    learner's turn, and `finish()` at the end; `params()` is the global model."""

    def __init__(self, models: list[torch.nn.Module], cfg: SyncConfig):
        if cfg.blend:
            raise ValueError("device rounds overwrite or keep the overlap on apply: blend is not supported")
        self.cfg = cfg
        self.specs = tensor_specs(models[0])
        self.layout = plan_fragments(self.specs, cfg.fragments)
        if any(f.role != "params" for f in self.layout):
            raise ValueError("device rounds need a model whose state is trained parameters only (no buffers)")
        self.tensors = [[[named_state(m)[s.name] for s in f.specs] for f in self.layout] for m in models]
        first = [self._flat(0, p) for p in range(len(self.layout))]
        self.fragments = [Global(values, cfg) for values in first]
        self.slots = [[Slot(values.clone()) for values in first] for _ in models]
        self.steps = [0] * len(models)
        self.step_tokens = [0.0] * len(models)
        self.left: set[int] = set()
        self.rounds: dict[int, list[Push]] = {}
        self.stage_bf16 = cfg.codec == "int4" and first[0].device.type == "cpu"
        self.closed = 0

    # ---- the learner's side ----------------------------------------------------------------------------------------
    def _flat(self, m: int, p: int) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in self.tensors[m][p]])

    def _write(self, m: int, p: int, flat: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for t in self.tensors[m][p]:
                t.copy_(flat[offset: offset + t.numel()].view_as(t))
                offset += t.numel()

    def stepped(self, m: int, tokens: int) -> None:
        """Learner m took an optimizer step on `tokens` tokens: count it, push what is due, apply what is ready."""
        self.steps[m] += 1
        self.step_tokens[m] = float(tokens)
        for slot in self.slots[m]:
            slot.steps += 1
            slot.tokens += tokens
        for p in due(self.steps[m], self.cfg.sync_every, self.cfg.fragments):
            if self.slots[m][p].pushed_at is None:
                self._push(m, p, final=False)
        for p, slot in enumerate(self.slots[m]):
            if slot.ready is not None and (slot.pushed_at is None  # published to every live learner: at once
                                           or self.steps[m] >= slot.pushed_at + self.cfg.overlap):
                self._apply(m, p)

    def _push(self, m: int, p: int, final: bool) -> None:
        slot = self.slots[m][p]
        local = self._flat(m, p)
        delta = slot.base - local
        if self.stage_bf16:  # as the learner stages an int4 push from a CPU model
            delta = delta.to(torch.bfloat16)
        counted = counted_as(slot.tokens, slot.steps, self.cfg)
        self.rounds.setdefault(p, []).append(Push(m, codec.round_trip(delta, self.cfg.codec), counted, slot.version,
                                                  final))
        keep = self.cfg.keep_overlap and not final
        slot.kept = (delta if self.stage_bf16 else local) if keep else None
        slot.pushed_at, slot.steps, slot.tokens = self.steps[m], 0, 0

    def _apply(self, m: int, p: int) -> None:
        slot = self.slots[m][p]
        values, version, change = slot.ready
        if slot.kept is not None and self.stage_bf16:
            # θ ← θ + (Θ − base at push) + Δ, which is Θ + (θ − θ at push): the steps since the push stay; summed
            # in the learner's order (`staging.kept_progress`)
            gain = change.clone() if change is not None and version == slot.version + 1 else values - slot.base
            self._write(m, p, self._flat(m, p) + gain.add_(slot.kept.to(torch.float32)))
        elif slot.kept is not None:  # θ ← (θ − θ at push) + Θ
            self._write(m, p, (self._flat(m, p) - slot.kept).add_(values))
        else:
            self._write(m, p, values)
        slot.base, slot.version, slot.ready, slot.pushed_at, slot.kept = values, version, None, None, None

    # ---- the syncer's side -----------------------------------------------------------------------------------------
    def end_turn(self) -> None:
        """Close every round that got pushes this turn."""
        for p in sorted(self.rounds):
            self._close(p, self.rounds[p])
        self.rounds = {}

    def _close(self, p: int, pushes: list[Push]) -> None:
        fs, fragment = self.fragments[p], self.layout[p]
        weights = torch.tensor([token_weight(*x.counted, fs.version - x.base_version, self.cfg.staleness_decay)
                                for x in pushes])
        # an asynchronous copy: a blocking one from host memory would wait for the device's queue to drain
        delta = merge([x.delta for x in pushes], weights.to(pushes[0].delta.device, non_blocking=True),
                      segments(fragment), self.cfg.merge)
        share = 1.0
        if self.cfg.scale_partial_rounds:
            present = {x.learner for x in pushes}
            tokens = sum(x.counted[0] for x in pushes)
            missing = sum(self.cfg.sync_every * self.step_tokens[m] for m in range(len(self.slots))
                          if m not in present and m not in self.left)
            share = tokens / (tokens + missing) if tokens > 0 else 1.0
            if share < 1.0:
                delta.mul_(share)
        lossy = self.cfg.down_codec != "fp32"
        if lossy and fs.published is None:  # P was Θ until now: the first lossy change is taken from it
            fs.published = fs.theta.clone()
        theta = fs.outer_values()
        fs.pending_share = outer_update(theta, delta, self.cfg, fs.momentum, fs.pending, share, fs.pending_share,
                                        all(x.final for x in pushes))
        if lossy:  # P_v = P_{v−1} + what the learners decode of Θ_v − P_{v−1}
            change = codec.round_trip(theta - fs.published, self.cfg.down_codec)
            fs.published.add_(change)
            if self.cfg.bf16_residual:
                fs.residual, fs.theta = (theta - fs.published).to(torch.bfloat16), None
            else:
                fs.theta = theta
        else:
            fs.theta, change = theta, None
        fs.version += 1
        self.closed += 1
        answer = fs.values.clone()
        contributors = {x.learner for x in pushes}
        for m, slots in enumerate(self.slots):
            # `publish_to` live: a learner with no push of the fragment in flight takes it too (overwriting)
            wanted = m in contributors or (self.cfg.publish_to == "live" and slots[p].pushed_at is None)
            if wanted and m not in self.left:
                slots[p].ready = (answer, fs.version, change)

    def finish(self, m: int) -> None:
        """Learner m's end of training, as `Learner.finish`: apply every answer, push what is left (final)."""
        for p, slot in enumerate(self.slots[m]):
            if slot.ready is not None:
                self._apply(m, p)
        for p, slot in enumerate(self.slots[m]):
            if slot.steps and slot.pushed_at is None:
                self._push(m, p, final=True)
        self.left.add(m)

    def params(self) -> dict[str, torch.Tensor]:
        """The global model Θ as a state_dict (fp32; a tied head as a copy of what it shares), as the syncer's."""
        out = {}
        for fragment, fs in zip(self.layout, self.fragments):
            offset, theta = 0, fs.outer_values()
            for s in fragment.specs:
                out[s.name] = theta[offset: offset + s.numel].view(s.shape).clone()
                offset += s.numel
        return {s.name: out[s.alias_of].clone() if s.kind == "alias" else out[s.name] for s in self.specs}
