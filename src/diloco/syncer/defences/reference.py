"""Robust references for what learners declare: per credential, so that one party cannot move them.

A learner's counters (tokens, steps) and the size of its outer gradients are its own word. Each is judged against
what *other* credentials' accepted contributions looked like: the median over those credentials of each one's
recent median. Many ids of one credential count once, and a credential is never its own reference, so a
hostile party can neither vouch for itself nor outvote the others by multiplying its ids.
"""

from __future__ import annotations

import statistics
from collections import OrderedDict, deque

HISTORY = 5
"""Recent accepted values kept per credential: short, so references follow a learning-rate warmup."""
CREDENTIALS_KEPT = 256
"""Credentials remembered per reference (the least recently heard forgotten first): bounded memory."""


class PerCredential:
    """Recent accepted values of one quantity, per credential. Not thread-safe: the syncer calls it under its lock."""

    def __init__(self, history: int = HISTORY, kept: int = CREDENTIALS_KEPT):
        self.history, self.kept = history, kept
        self.values: OrderedDict[str, deque[float]] = OrderedDict()

    def add(self, credential: str, value: float) -> None:
        kept = self.values.pop(credential, None) or deque(maxlen=self.history)
        kept.append(value)
        self.values[credential] = kept  # most recently heard last
        while len(self.values) > self.kept:
            self.values.popitem(last=False)

    def medians(self, exclude: str | None = None) -> list[float]:
        """Each credential's median, but `exclude`'s."""
        return [statistics.median(v) for c, v in self.values.items() if c != exclude and v]

    def reference(self, exclude: str | None = None) -> float | None:
        """The median over credentials other than `exclude` of their medians; None when there are none."""
        medians = self.medians(exclude)
        return statistics.median(medians) if medians else None

    def samples(self) -> int:
        return sum(len(v) for v in self.values.values())

    def credentials(self) -> set[str]:
        return set(self.values)


class Counters:
    """Tokens per step of accepted parameter contributions, per credential: the reference a contribution's declared
    counters are bounded by (`plausible`)."""

    def __init__(self):
        self.per_step = PerCredential()
        self.per_second = PerCredential()
        """Tokens per second of accepted contributions: tokens over the time since the same learner's push of the
        same fragment before (every token trains every fragment)."""

    def accept(self, credential: str, tokens: float, steps: float) -> None:
        self.per_step.add(credential, tokens / steps)

    def accept_rate(self, credential: str, tokens: float, seconds: float) -> None:
        if seconds > 0:
            self.per_second.add(credential, tokens / seconds)

    def in_time(self, credential: str, tokens: float, seconds: float, ratio: float) -> float:
        """`tokens` at most `ratio` × what the others typically train in `seconds`; 0 without a reference. A
        learner whose pushes waited (a fragment's last result still out, a slow link) carries more than H steps'
        tokens, all trained: bounded by time rather than by H, they count toward the budget."""
        reference = self.per_second.reference(credential)
        return min(tokens, ratio * reference * seconds) if reference is not None and ratio else 0.0

    def plausible(self, credential: str, tokens: float, steps: float, ratio: float, cycle: int) -> tuple[float, float]:
        """(tokens, steps) with tokens per step at most `ratio` × the others' typical and tokens at most `ratio` ×
        their typical cycle (`cycle` = H steps) of them; steps follow. With contributions counted up to H steps
        (`counted_as`), the weight tokens²/steps is then at most ratio² × an honest full contribution's. Unchanged
        when `ratio` is 0 or no other credential has a contribution accepted yet."""
        if not ratio:
            return tokens, steps
        reference = self.per_step.reference(credential)
        if reference is None:
            return tokens, steps
        rate = min(tokens / steps, ratio * reference)
        tokens = min(tokens, ratio * reference * cycle)
        return tokens, tokens / rate
