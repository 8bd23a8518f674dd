"""Per-learner bookkeeping on the syncer: liveness, progress and the tokens each learner got merged."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass, field

from diloco.algorithm.policy import MovingAverage


def session_hash(secret: str) -> str:
    """What is kept of a session secret at rest: its SHA-256 (128 random bits: not to be guessed back from it)."""
    return hashlib.sha256(b"diloco-session\0" + secret.encode()).hexdigest()


def hashed_seqs(merged_seq: dict[str, int]) -> dict[str, int]:
    """`merged_seq` keyed by "session hash:fragment" instead of "secret:fragment" (restored keys already are)."""
    out: dict[str, int] = {}
    for key, seq in merged_seq.items():
        session, _, fragment = key.rpartition(":")
        hashed = f"{session if len(session) == 64 else session_hash(session)}:{fragment}"
        out[hashed] = max(seq, out.get(hashed, 0))
    return out


@dataclass
class LearnerRecord:
    id: str
    session: str
    """Its current session secret, in memory only: "" in a record restored from disk, which knows the session by
    `restored_hash` until the learner joins again, and authenticates it by hashing what it presents."""
    joined_at: float
    """When its current session began (its latest join)."""
    last_seen: float
    left: bool = False
    left_at: float | None = None
    """When it last left the run on its own (a leave, not an absence); None while it is in it."""
    step: int = 0
    tokens_trained: int = 0
    """Tokens it trained in all its sessions: its current session's count (its heartbeats) on `tokens_base`."""
    tokens_base: int = 0
    """Tokens it trained in its earlier sessions, as last heard: a learner that restarts counts from 0 again."""
    steps_base: int = 0
    """Steps it took in its earlier sessions, as last heard: `step` is its current session's count on this."""
    absent: bool = False
    """Whether its absence was noted (logged) and it has not been heard from since; not saved."""
    tokens_merged: float = 0.0
    """Σ tokens of this learner's merged contributions, divided by P (each token trains every fragment)."""
    data_position: int = 0
    """Data position of this learner's latest merged contribution: where a rejoining learner resumes, so no data
    is read twice. Fragments whose own last merge came earlier lose that bit of progress (under one period)."""
    loss: float | None = None
    tokens_per_second: float | None = None
    pushes: int = 0
    merged: int = 0
    refused: int = 0
    applied: int = 0
    speed: float | None = None
    step_time: MovingAverage = field(default_factory=MovingAverage)
    contribution_tokens: MovingAverage = field(default_factory=MovingAverage)
    """Typical tokens per merged contribution: how much a round misses when this learner is not in it."""
    staleness: int = 0
    """Versions its latest accepted contribution was behind the fragment it was merged into."""
    last_push: tuple[float, int] | None = None
    """(clock time, fragment) of its latest push: its phase in the push schedule."""
    start_position: int | None = None
    """Where its push schedule starts in a synchronous mode, set at join (SyncerCore._start_position)."""
    restored_hash: str = ""
    """`session_hash` of its session when the state was saved (a restored record; the ledger holds no secret)."""
    pushed_at: dict[int, float] = field(default_factory=dict)
    """Per parameter fragment, when its latest accepted push of it arrived: the time its next one had to train in
    (`Counters.in_time`). Not saved."""
    versions: dict[int, int] = field(default_factory=dict)
    """Per fragment, the version v of the published values P_v this learner holds: downlink changes start there.
    Not saved: after a restart every learner gets full values once (it may have missed what was being sent)."""
    finished: set[int] = field(default_factory=set)
    """Fragments whose last push (`final`: its training ended) was merged: it reads none of their results again, so
    none is sent and what it held of them keeps no downlink change. Not saved."""
    merged_seq: dict[str, int] = field(default_factory=dict)
    """Highest merged push sequence number per "session:fragment": a re-sent push is merged at most once."""
    credential: str = ""
    """Who vouched for this learner: its own credential's name, or its id under a shared run token (each id then
    counts as a party of its own). References of declared values are per credential (syncer/defences/reference.py)."""
    step_tokens: float = 0.0
    """Tokens per step of its latest accepted parameter contribution, as counted (bounded): two cycles of them are
    how far its heartbeats may run ahead of its accepted pushes in the budget."""
    tokens_accepted: float = 0.0
    """Tokens its accepted parameter pushes carried (bounded as weights are), per fragment they cover: what the
    token budget and the learning-rate progress count, never heartbeat claims alone."""
    tokens_backed: float = 0.0
    """Its heartbeats' claim (`tokens_trained`) as of its latest accepted parameter push, each push vouching for
    at most what it had time to train since the one before (`SyncerCore._backed`). Counts in the budget beside
    `tokens_accepted`: a learner that applies merged values between its pushes (results published to every live
    learner) restarts its pushes' counters there, and one whose pushes of a fragment wait on its last result
    pushes that fragment seldom."""
    backed_at: float | None = None
    """When `tokens_backed` was last raised (the clock). Not saved."""
    proof: str = ""
    """`credentials.proof` of the token its session was opened with ("" without a credentials file): a reload of
    the file, or a restart on it, closes the session once that token is no longer listed for its credential."""
    revoked: bool = False
    """Its credential was revoked and its session closed (syncer/revocation.py). Not saved: a restart checks the
    file again."""

    SAVED = ("id", "left", "step", "tokens_trained", "tokens_merged", "data_position", "loss",
             "tokens_per_second", "pushes", "merged", "refused", "applied", "speed", "merged_seq",
             "credential", "tokens_accepted", "tokens_backed", "tokens_base", "steps_base")

    @property
    def session_hash(self) -> str:
        return session_hash(self.session) if self.session else self.restored_hash

    def check_session(self, secret: str) -> bool:
        """Whether `secret` is this learner's current session secret: compared by hash, in constant time."""
        return hmac.compare_digest(self.session_hash, session_hash(secret))

    def merged_before(self, secret: str, fragment: int) -> int:
        """Highest merged sequence number of this session's pushes of `fragment`, 0 if none; a restored record's
        keys hold the session's hash."""
        return max(self.merged_seq.get(f"{secret}:{fragment}", 0),
                   self.merged_seq.get(f"{session_hash(secret)}:{fragment}", 0))

    def to_json(self) -> dict:
        """The saved form: hashes of session secrets, never the secrets (a reader of the state cannot act as it)."""
        out = {k: getattr(self, k) for k in self.SAVED}
        out.update(session_hash=self.session_hash, merged_seq=hashed_seqs(self.merged_seq))
        out.update(step_time=self.step_time.value, contribution_tokens=self.contribution_tokens.value)
        out["proof"] = self.proof
        return out

    @classmethod
    def from_json(cls, data: dict, now: float) -> "LearnerRecord":
        record = cls(data["id"], "", now, now)
        record.restored_hash = data["session_hash"] if "session_hash" in data else session_hash(data["session"])
        if not isinstance(record.restored_hash, str):
            raise TypeError(f"session_hash of learner {record.id!r} is not a string")
        optional = ("credential", "tokens_accepted", "tokens_backed", "tokens_base", "steps_base")  # absent from older ledgers
        for k in cls.SAVED:
            if k in data or k not in optional:
                setattr(record, k, data[k])
        record.merged_seq = hashed_seqs(record.merged_seq)  # a ledger saved with secrets in it: hashed now
        record.step_time.value, record.contribution_tokens.value = data["step_time"], data["contribution_tokens"]
        record.proof = data.get("proof", "")  # absent from older ledgers: the session is checked by its id alone
        if not isinstance(record.proof, str):
            raise TypeError(f"proof of learner {record.id!r} is not a string")
        return record

    def summary(self, now: float, absent_after: float, backed: float | None = None) -> dict:
        """/status's entry. `backed`: the tokens its accepted pushes back (`Membership.budget_tokens`), shown as
        `tokens_trained`; its heartbeats' count is `tokens_claimed` (and `tokens`, the older name)."""
        state = "left" if self.left else ("live" if now - self.last_seen <= absent_after else "absent")
        return {
            "id": self.id, "state": state, "step": self.step, "tokens": self.tokens_trained,
            "tokens_claimed": self.tokens_trained,
            **({} if backed is None else {"tokens_trained": int(backed)}),
            **({"revoked": True} if self.revoked else {}),
            "tokens_merged": self.tokens_merged, "data_position": self.data_position, "loss": self.loss,
            "tokens_per_second": self.tokens_per_second,
            "pushes": self.pushes, "merged": self.merged, "refused": self.refused, "applied": self.applied,
            "speed": self.speed, "step_seconds": self.step_time.value, "last_seen_ago": round(now - self.last_seen, 3),
            "staleness": self.staleness,
            "last_push_ago": None if self.last_push is None else round(now - self.last_push[0], 3),
        }


NOBODY = LearnerRecord("", secrets.token_urlsafe(16), 0.0, 0.0)
"""Checked against when a learner id is unknown: the answer costs the same work as for a known one."""
