"""What a learner needs to rejoin its run after its framework resumes from a checkpoint: its id, where its data
stood (the framework's optimizer steps), and the fragment versions it held. Written into every checkpoint (a small
JSON file in a Hugging Face checkpoint folder, a callback state in a Lightning checkpoint) and compared with what
the syncer says at the rejoin, so a resumed trainer goes on in the same run under the same id."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from diloco import untrusted_files
from diloco.atomic import write_json

RECORD_FILE = "diloco_learner.json"
"""The record's name in a Hugging Face checkpoint folder (beside trainer_state.json)."""
FORMAT = 1
MAX_BYTES = 1 << 20
"""Largest record read (one is a few hundred bytes)."""


@dataclass(frozen=True)
class RejoinRecord:
    learner_id: str
    data_position: int
    """Optimizer steps the framework had trained when the checkpoint was written (its global step)."""
    tokens: int = 0
    """Tokens this learner had reported since it last joined."""
    versions: dict[int, int] = field(default_factory=dict)
    """Version of each fragment this learner held (its base), by fragment index."""

    def to_json(self) -> dict:
        out = asdict(self)
        out["versions"] = {str(p): v for p, v in self.versions.items()}
        return {"format": FORMAT, **out}

    @classmethod
    def from_json(cls, obj, source: str) -> RejoinRecord:
        try:
            if obj.get("format") != FORMAT:
                raise ValueError(f"format {obj.get('format')!r}, expected {FORMAT}")
            return cls(learner_id=str(obj["learner_id"]), data_position=int(obj["data_position"]),
                       tokens=int(obj.get("tokens", 0)),
                       versions={int(p): int(v) for p, v in dict(obj.get("versions", {})).items()})
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{source} is not a diloco rejoin record ({e}): delete it to join as a new "
                             f"learner") from None


def write(folder: Path, record: RejoinRecord) -> Path:
    path = Path(folder) / RECORD_FILE
    write_json(path, record.to_json(), indent=1)
    return path


def read(folder: Path) -> RejoinRecord | None:
    """The record in a checkpoint folder; None when it has none (a checkpoint written without the callback)."""
    path = Path(folder) / RECORD_FILE
    try:  # a link is followed (checkpoint caches link their files), but only to a regular file
        obj = untrusted_files.read_json(path, MAX_BYTES, follow_symlinks=True)
    except FileNotFoundError:
        return None
    except untrusted_files.UntrustedFileError as e:
        raise ValueError(f"{path} is {e.why}: delete it to join as a new learner") from None
    return RejoinRecord.from_json(obj, str(path))


def check_id(record: RejoinRecord, learner_id: str, source: str) -> None:
    """A checkpoint resumed under another learner's id would train on one shard while the ledger books another."""
    if record.learner_id != learner_id:
        raise ValueError(f"the checkpoint {source} was written by learner {record.learner_id!r}, but this callback "
                         f"joins as {learner_id!r}: pass learner_id={record.learner_id!r} to resume it, or start "
                         f"without resuming to join as a new learner")


def compare(record: RejoinRecord, ledger_position: int, versions: dict[int, int], source: str) -> list[str]:
    """What differs between the checkpoint and the run the learner rejoined, as sentences to log."""
    notes = []
    behind = {p: (v, versions[p]) for p, v in record.versions.items() if p in versions and versions[p] < v}
    if behind:
        p, (held, now) = min(behind.items())
        notes.append(f"the syncer's fragment {p} is at version {now}, below the {held} that {source} held: the "
                     f"syncer restarted from an older state, or this is another run")
    gap = ledger_position - record.data_position
    if ledger_position and gap > 0:
        notes.append(f"the syncer merged this learner's work up to step {ledger_position}, {gap} steps past "
                     f"{source}: their data is trained again")
    elif ledger_position and gap < 0:
        notes.append(f"the syncer merged this learner's work up to step {ledger_position} only: the last {-gap} "
                     f"steps before {source} never reached the global model and their data is not trained again")
    return notes
