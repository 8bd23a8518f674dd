"""The global model's held-out loss while a run goes on: each snapshot the syncer saves is evaluated as it appears
and posted to the syncer's dashboard (`POST /annotate`). The report reuses these losses instead of evaluating the
same snapshots again (`cached`)."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import torch
from safetensors import safe_open

from diloco.syncer.observation import annotations
from diloco.train.data import Corpus, eval_batches, evaluate
from diloco.train.model import build_model

log = logging.getLogger(__name__)

CACHE = "live_eval.json"
"""{snapshot file name: held-out loss}, in the run directory."""


class LiveEval:
    """A daemon thread evaluating new snapshots in `snapshots` every `interval` seconds until `stop`."""

    def __init__(self, train, snapshots: Path, out: Path, http_ports: list[int], interval: float = 1.0):
        self.train, self.snapshots, self.out, self.http_ports = train, snapshots, out, http_ports
        self.interval = interval
        self.losses: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="live-eval", daemon=True)

    def start(self) -> "LiveEval":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)

    def _run(self) -> None:

        model = build_model(self.train.model, self.train.seed)
        batches = eval_batches(Corpus.from_config(self.train).heldout, self.train.model.seq_len,
                               self.train.eval_batches, self.train.eval_batch_size)
        while not self._stop.wait(self.interval):
            for path in sorted(self.snapshots.glob("*.safetensors")):
                if path.name in self.losses or self._stop.is_set():
                    continue
                try:
                    meta = load_params(model, path)
                except Exception as e:  # noqa: BLE001 - a snapshot still being written or damaged: the report decides
                    log.debug("live evaluation skips %s: %s", path.name, e)
                    continue
                with torch.no_grad():
                    loss = evaluate(model, batches)
                self.losses[path.name] = loss
                (self.out / CACHE).write_text(json.dumps(self.losses))
                note = {"kind": "eval", "loss": loss, "source": "diloco-run",
                        "tokens_trained": int(float(meta.get("tokens_trained", 0))),
                        "seconds": float(meta.get("seconds", 0))}
                for port in self.http_ports:
                    problem = annotations.post(f"127.0.0.1:{port}", note)
                    if problem:
                        log.debug("could not post the held-out loss to port %d: %s", port, problem)


def cached(out: Path) -> dict[str, float]:
    """The losses a LiveEval of this run wrote, by snapshot file name (empty if none)."""
    try:
        data = json.loads((out / CACHE).read_text())
    except (OSError, ValueError):
        return {}
    return {k: float(v) for k, v in data.items() if isinstance(k, str) and isinstance(v, (int, float))}


def load_params(model: torch.nn.Module, path: Path) -> dict:
    """Copy a saved global model into `model` by parameter name; returns the file's metadata."""
    params = dict(model.named_parameters())
    with safe_open(str(path), framework="pt") as f:
        missing = set(params) - set(f.keys())
        if missing:
            raise ValueError(f"{path} lacks parameters {sorted(missing)[:3]}: it was saved from a different model")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(f.get_tensor(name))
        return dict(f.metadata() or {})
