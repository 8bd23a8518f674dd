"""The direction test (`SyncConfig.direction_floor`): a contribution against the fragment's recent merged steps,
which no single party moves alone.

- **Reference**, per parameter fragment: r ← DECAY·r + Δ of every published round (the step the round applied,
  after its share), kept in bf16: half the fragment's fp32 size. A contribution the test scales down is merged
  scaled down, so it moves r no more than it moves the model; the rounds of the others, three quarters of them
  with one hostile learner in four, keep r pointing where honest training goes.
- **Cosine**: cos(Δ, r) of every contribution with a non-zero Δ, once r exists (the tape records it). Once r is
  ready (below), each credential's recent ones are kept (syncer/defences/reference.py: 5 per credential, 256 credentials),
  and the *typical* cosine a contribution is judged against is the median over the other credentials of their
  medians: neither many ids of one party nor its own history move it.
- **Factor**: a contribution is merged with its Δ and its weight multiplied by c / (floor × typical), at most 1
  and at least 0, where c is its credential's recent median cosine, this one included. A sign flip (median
  cos < 0) or noise (median cos ≈ 0) is merged with (near) no weight, whatever one of its cosines happens to be.
  Honest contributions keep their full weight even when one points against r, as 5–10% of them do (mostly on
  fragments whose consecutive merged steps alternate in sign): judged one by one, they were zeroed and a flip
  whose cosine happened to be positive passed, and a flip that passed turned r against the honest learners.
  The price: a credential that pushes honest steps most of the time keeps its weight on the few hostile ones in
  between (fewer than half of its last five): together they cancel its own progress, no more.
- **Passes**: everything until r has taken in WARMUP_ROUNDS rounds with contributors of WARMUP_CREDENTIALS
  credentials (a hostile party can push a fragment's first rounds: r would point its way) and until another
  credential has a cosine; and everything while the others' typical cosine is under MIN_TYPICAL, which means r
  is not what the other credentials follow (a hostile party's rounds made it). When most credentials' medians
  are that low, every cosine measured so far is forgotten, and the rounds of all, merged in full, remake r.
  A hostile party therefore gets its first push or two of each fragment merged, and a few more while r is being
  remade; in runs of 300 steps (twelve pushes per fragment) 12–23% of a sign-flipping learner's weight was
  merged, against 96–98% of honest learners' weight.

Measured before it was built (docs/results.md, "Hostile learners"; tiny model, one learner in four hostile,
`benchmarks/hostile/results/direction_cosines_tiny.json`): honest contributions have a median cosine of about 0.45 with r
(5–10% below 0), a sign-flipping learner's −0.43 (88% below 0), one pushing noise 0.00, replays of its own pushes
from ten pushes back 0.01. Memory: the fragment's numel in bf16 per parameter fragment (not persisted: a restarted
syncer warms up again), and O(1) per credential.
"""

from __future__ import annotations

import statistics

import torch

from diloco.syncer.defences.reference import PerCredential

DECAY = 0.5
"""r's decay per published round: short, so r follows training and rounds of one party do not pile up in it."""
MIN_OTHERS = 1
"""Other credentials with cosines before a contribution is judged."""
MIN_TYPICAL = 0.1
"""The others' typical cosine below which r is not what they follow (honest fragments' medians measured 0.10–0.9):
then the contribution passes, and when most credentials' medians (of three at least) are this low, every
credential's cosines are forgotten, having been measured against an r that the merged rounds of all are about to
remake. Kept, a hostile party's cosines from when its rounds had made r kept it passing for several pushes after
r was honest again, while honest learners, judged by theirs, were zeroed: in some fragments for the rest of the
run."""
WARMUP_ROUNDS = 2
WARMUP_CREDENTIALS = 3
"""Rounds, and credentials among their contributors, r takes in before anything is judged by it. A hostile party
can push a fragment's first round (every one of them, in one measured run): r made of that round alone, or of two,
points its way."""
CHUNK = 1 << 20
"""Values of r widened to fp32 at a time for ⟨Δ, r⟩ and ‖r‖ (4 MiB): whole, it would be a fragment-sized
temporary; r updated in one such pass costs about what ⟨Δ, r⟩ does (unchunked, the mixed bf16/fp32 update took
ten times as long here)."""


class DirectionGuard:
    """The direction test of one parameter fragment. The reference is touched only by the core worker (pushes and
    round closes); `judge` runs under the syncer's lock."""

    def __init__(self, numel: int, floor: float):
        self.numel, self.floor = numel, floor
        self.reference: torch.Tensor | None = None
        """r in bf16, made when the fragment's first round is published."""
        self.reference_norm = 0.0
        self.cosines = PerCredential()
        self.rounds = 0
        self.formed_by: set[str] | None = set()
        """Credentials whose rounds r took in, until it has WARMUP_ROUNDS of them and WARMUP_CREDENTIALS (then
        None: ready)."""
        self.forgotten = 0
        """Times the cosines were forgotten because the others' typical one fell under MIN_TYPICAL."""

    @property
    def ready(self) -> bool:
        return self.formed_by is None

    def cosine(self, delta: torch.Tensor, norm: float) -> float | None:
        """cos(Δ, r) for a Δ of norm `norm`; None before r exists or for a zero Δ."""
        if self.reference is None or self.reference_norm <= 0 or not norm > 0:
            return None
        dot = 0.0
        for lo in range(0, self.numel, CHUNK):
            dot += torch.dot(delta[lo : lo + CHUNK], self.reference[lo : lo + CHUNK].float()).item()
        return max(-1.0, min(1.0, dot / (norm * self.reference_norm)))

    def judge(self, credential: str, cosine: float | None) -> float:
        """The factor in [0, 1] a contribution of `credential` with this cosine is merged with; once r is ready,
        its cosine joins the credential's history."""
        if cosine is None or not self.ready:
            return 1.0
        medians = self.cosines.medians(credential)
        self.cosines.add(credential, cosine)
        if len(medians) < MIN_OTHERS:
            return 1.0
        typical = statistics.median(medians)
        # judged by its credential's recent median (this one included), not by this cosine alone: honest steps
        # point against r now and then (an outer step that overshot is taken back), a hostile party's do so always
        own = statistics.median(self.cosines.values[credential])
        if typical < MIN_TYPICAL:
            # most credentials, of three at least, not following r: forget what was measured against it (one
            # party alone, whose own median is low, cannot make the others' cosines forgotten)
            everyone = [*medians, own]
            if len(everyone) >= 3 and 2 * sum(m < MIN_TYPICAL for m in everyone) > len(everyone):
                self.cosines = PerCredential()
                self.forgotten += 1
            return 1.0
        return min(1.0, max(0.0, own) / (self.floor * typical))

    def published(self, delta: torch.Tensor, credentials: set[str]) -> None:
        """A round of the fragment, with contributors of `credentials`, applied `delta`: r ← DECAY·r + Δ."""
        if self.formed_by is not None:
            self.rounds += 1
            self.formed_by |= credentials
            if self.rounds >= WARMUP_ROUNDS and len(self.formed_by) >= WARMUP_CREDENTIALS:
                self.formed_by = None
        if self.reference is None:
            self.reference = torch.zeros(self.numel, dtype=torch.bfloat16)
        total = 0.0
        for lo in range(0, self.numel, CHUNK):
            part = self.reference[lo : lo + CHUNK]
            part.mul_(DECAY).add_(delta[lo : lo + CHUNK])
            wide = part.float()
            total += torch.dot(wide, wide).item()
        self.reference_norm = total ** 0.5
