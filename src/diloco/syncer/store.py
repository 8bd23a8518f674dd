"""The syncer's durable state (DESIGN §3.8): a manifest naming one consistent set of files.

Every write goes to a temporary file, is fsynced and renamed; the manifest is replaced last, so a crash at any
point leaves the previous manifest and every file it names intact. Superseded files are removed only after the new
manifest is in place.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from diloco.atomic import fsync_dir, save_tensors, write_bytes, write_json

MANIFEST = "manifest.json"
ROUND_LOG = "rounds.jsonl"


@dataclass
class Loaded:
    ledger: dict
    fragments: dict[int, dict[str, torch.Tensor]]


class StateStore:
    """Files under `folder`: manifest.json, ledger-<n>.json, fragment-<p>-v<version>.safetensors."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.generation = 0
        self.files: dict[str, str] = {}
        if (self.folder / MANIFEST).exists():
            manifest = json.loads((self.folder / MANIFEST).read_text())
            self.generation, self.files = manifest["generation"], manifest["files"]

    @property
    def exists(self) -> bool:
        return bool(self.files)

    def save(self, ledger: dict, fragments: dict[int, tuple[int, dict[str, torch.Tensor]]]) -> None:
        """Write the ledger and the given fragments ({index: (version, tensors)}), then switch the manifest."""
        self.generation += 1
        files = dict(self.files)
        for index, (version, tensors) in fragments.items():
            name = f"fragment-{index}-v{version}.safetensors"
            save_tensors(self.folder / name, tensors)
            files[f"fragment-{index}"] = name
        ledger_name = f"ledger-{self.generation}.json"
        write_json(self.folder / ledger_name, ledger)
        files["ledger"] = ledger_name
        fsync_dir(self.folder)
        write_json(self.folder / MANIFEST, {"generation": self.generation, "files": files})
        fsync_dir(self.folder)
        stale = set(self.files.values()) - set(files.values())
        self.files = files
        for name in stale:
            (self.folder / name).unlink(missing_ok=True)

    def append_round(self, entry: tuple) -> None:
        """One line per closed round, appended (not fsynced): the history behind uptime, not needed to resume."""
        with open(self.folder / ROUND_LOG, "a") as f:
            f.write(json.dumps(entry) + "\n")

    def rounds(self, last: int) -> list[tuple]:
        """The last `last` rounds of the history; a line cut by a crash is skipped."""
        path = self.folder / ROUND_LOG
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines()[-last:]:
            try:
                out.append(tuple(json.loads(line)))
            except json.JSONDecodeError:
                continue
        return out

    def rewrite_rounds(self, entries: list[tuple]) -> None:
        write_bytes(self.folder / ROUND_LOG, "".join(json.dumps(list(e)) + "\n" for e in entries).encode())

    def load(self) -> Loaded | None:
        """The newest consistent state, or None when nothing was ever saved."""
        if not self.files:
            return None
        ledger = json.loads((self.folder / self.files["ledger"]).read_text())
        fragments = {}
        for key, name in self.files.items():
            if key.startswith("fragment-"):
                fragments[int(key.split("-")[1])] = load_file(str(self.folder / name))
        return Loaded(ledger, fragments)
