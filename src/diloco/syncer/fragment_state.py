"""Per-fragment syncer state: one accepted contribution's metadata, and a fragment's values, outer state, open
round and published copy."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

import torch

from diloco.algorithm.fragments import Fragment
from diloco.algorithm.merge import StreamingMerge
from diloco.syncer.defences.direction_guard import DirectionGuard
from diloco.syncer.defences.norm_guard import NormGuard
from diloco.syncer.defences.replayed import RecentPayloads


@dataclass
class Contribution:
    learner: str
    session: str
    seq: int
    base_version: int
    steps: int
    tokens: int
    data_position: int
    arrived_at: float | None = None
    counted: tuple[float, float] | None = None
    """(tokens, steps) it counts for in weights, shares and the budget: at most H steps' worth (`counted_as`),
    bounded against other credentials' typical counters (`Counters.plausible`); None: as declared."""
    direction: float = 1.0
    """The direction test's factor (`SyncConfig.direction_floor`): its Δ and weight were merged times this."""
    cosine: float | None = None
    """Its Δ's cosine with the fragment's recent steps, when the direction test measured one."""
    agreement: float = 1.0
    """The agreement test's factor (`SyncConfig.agreement_floor`), set when its round closes."""
    agreement_score: float | None = None
    """Its agreement with the other contributions of its round, when the agreement test measured one."""
    sketch: torch.Tensor | None = None
    """With the agreement test: a small summary of its Δ (syncer/defences/agreement.py)."""
    encoded: object | None = None
    """With the agreement test: its payload as it arrived, to fold it in anew when the test scales it down."""
    scale: float = 1.0
    """What its decoded Δ was multiplied by before it was folded in (the robust merge's clip, the direction test)."""
    norms: list[float] | None = None
    """`segment_norms` of its Δ times `scale`, as measured on arrival: folded in anew, it is not read for them again."""
    weight: float = 0.0
    """The weight it was folded in with."""
    bounded: bool = False
    """Whether those bounds (or a zero Δ) lowered `counted` below what `counted_as` makes of its counters."""
    """Clock time the push was accepted (the tape records it: a replay can ask when a round could have closed)."""
    earlier: tuple[int, int] = (0, 0)
    """(steps, tokens) of the earlier pushes it replaced (`SyncConfig.repeat_push` replace) that its own counters
    do not cover (`rounds.earlier_counters`); `steps` and `tokens` include them."""
    replaced: int = 0
    """Earlier pushes of its learner it replaced in this round."""
    since: float | None = None
    """With `replaced`: when the first of them arrived, since when its learner has been in the round."""
    carried: float = 0.0
    """Tokens it added to its learner's accepted tokens (the budget's bound): a replacement adds only the rest."""
    final: bool = False
    """The learner's last push of the fragment: training has ended (a round of only such pushes takes no momentum)."""
    check: tuple[int, dict] | None = None
    """(the round's version, what the policy decided on) when it let this push into an open round: the round was not
    due at its arrival (`SyncerCore._close_if_due`; the tape records it for `diloco replay`)."""


@dataclass
class FragmentState:
    fragment: Fragment
    theta: torch.Tensor | None
    """Θ in fp32; None once Θ is kept as P + `residual` (`SyncConfig.bf16_residual`, `outer_values`)."""
    momentum: torch.Tensor
    version: int = 0
    pending_delta: torch.Tensor | None = None
    """Σ of partial rounds' Δ since the momentum last advanced (delayed momentum)."""
    pending_share: float = 0.0
    guard: NormGuard | None = None
    """The outlier bounds contributions are judged against (None: the fragment is not a parameter fragment)."""
    direction: DirectionGuard | None = None
    """The direction test contributions are judged by (None: off, or not a parameter fragment)."""
    norm_at: tuple[int, float] | None = None
    """(version, ‖P_version‖), computed once per version for the outlier ceiling."""
    pending: dict[str, Contribution] = field(default_factory=dict)
    merging: StreamingMerge | None = None
    """The open round's running sums: pending contributions' Δ are folded in as they arrive, never stored (but in
    `kept`)."""
    kept: dict[str, tuple[torch.Tensor, float, list[float] | None]] = field(default_factory=dict)
    replays: RecentPayloads = field(default_factory=RecentPayloads)
    """Digests of the payloads accepted lately, to refuse verbatim replays (syncer/defences/replayed.py)."""
    agreement_peers: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)
    """With the agreement test: credential → (version, sketch) of its latest contribution in the last
    `agreement.PEER_ROUNDS` closed rounds, others that the next round's contributions are judged against too."""
    """With `SyncConfig.repeat_push` replace only: each pending contribution's decoded Δ (fp32, after any clip),
    weight and tensor norms, by learner, to rebuild `merging` from when one is replaced. Empty otherwise."""
    opened_at: float | None = None
    quorum_at: float | None = None
    at_quorum: dict | None = None
    """The policy's inputs when the round reached quorum (averages, predicted pushes), for the tape."""
    published: torch.Tensor | None = None
    """P_v, what every learner that received version v holds, kept only when a lossy down codec makes it differ
    from Θ (None: P_v is Θ)."""
    residual: torch.Tensor | None = None
    """Θ − P_v in bf16, with `published`: the quantisation error of the last change sent. Its rounding is below
    2^-8 of an error that is itself a fraction of one change, far below the resolution of Θ in fp32."""
    round_steps: deque = field(default_factory=lambda: deque(maxlen=32))
    """Norm per step of the fragment's latest published merged Δ, for the bound on the next (`max_round_ratio`)."""
    changes: deque = field(default_factory=deque)
    """(w, encoded P_w − P_{w−1}, CRC-32 of P_w) for the latest versions w: chains for learners a few behind."""
    checksum: tuple[int, int] | None = None
    """(version, CRC-32 of P_version), computed once per version."""
    loans: int = 0
    """Readers outside the core worker holding `values` (joins sending them while rounds go on): while any does,
    the next round writes a copy instead of changing them in place (`reclaim`)."""
    _loan_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def values(self) -> torch.Tensor:
        """P_v: what a learner holding the current version holds."""
        return self.theta if self.published is None else self.published

    def outer_values(self) -> torch.Tensor:
        """Θ in fp32: the kept tensor, or P + residual (a new tensor)."""
        if self.residual is None:
            return self.theta
        return self.published + self.residual

    def lend(self) -> torch.Tensor:
        """P_v for a reader outside the core worker: unchanged until the reader gives it back (`give_back`)."""
        with self._loan_lock:
            self.loans += 1
            return self.values

    def give_back(self, values: torch.Tensor) -> None:
        """A reader is done with `values` from `lend` (any thread). Values a round has replaced since are no
        longer the fragment's: nothing to count then."""
        with self._loan_lock:
            if values is self.values and self.loans > 0:
                self.loans -= 1

    def reclaim(self) -> None:
        """Before a round changes the values: leave lent ones to their readers and change a copy (copy on write),
        so a join costs no copy of the model unless rounds of its fragments close while it streams."""
        with self._loan_lock:
            if self.loans:
                if self.published is None:
                    self.theta = self.theta.clone()
                else:
                    self.published = self.published.clone()
                self.loans = 0


def fp32_bytes(fragments) -> int:
    """The fp32 size of `fragments` (FragmentStates): what the syncer's memory budgets are shares of."""
    return 4 * sum(fs.fragment.numel for fs in fragments)
