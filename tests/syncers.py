"""Real syncers on loopback and learners that train against them, for the end-to-end tests."""

import contextlib
import importlib.util
import threading
import time
from pathlib import Path

import torch
from torch import nn

from diloco import GrpcTransport, Learner, ServerOptions, SyncerThread, for_mode
from diloco.chaos import LinkFaults, ProxyThread
from fakes import TinyNet
from rpc import TOKEN


def start_syncer(stall_timeout=1.0, learners=2, initialise=True):
    """A syncer on loopback that wants `TOKEN`; with `initialise`, a first learner has uploaded the model (and left)."""
    syncer = SyncerThread(for_mode("decoupled", learners, fragments=2, sync_every=4),
                          ServerOptions(listen="127.0.0.1:0", http=None, token=TOKEN, stall_timeout=stall_timeout))
    if initialise:
        Learner(TinyNet(), GrpcTransport(syncer.address, token=TOKEN), "first").close()
    return syncer


class Honest:
    """A learner training in a thread on the real model, as a real user would."""

    def __init__(self, address):
        self.model = TinyNet()
        self.learner = Learner(self.model, GrpcTransport(address, token=TOKEN), "honest")
        self.stop = threading.Event()
        self.steps = 0
        self.error = None
        self.thread = threading.Thread(target=self._train, daemon=True)
        self.thread.start()

    def _train(self):
        opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        try:
            while not self.stop.is_set():
                opt.zero_grad()
                self.model.lin(self.model.emb(torch.arange(8))).pow(2).mean().backward()
                opt.step()
                self.learner.step(8)
                self.steps += 1
                time.sleep(0.01)
        except Exception as e:  # reported by the test
            self.error = e

    def finish(self):
        self.stop.set()
        self.thread.join(30)
        if self.error is None:
            self.learner.finish()


def trained_learner(address: str, name: str, steps: int = 12, pause: float = 0.0) -> Learner:
    """A learner of a small model that trained `steps` steps against the syncer at `address`."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16))
    learner = Learner(model, GrpcTransport(address), name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        x = torch.randint(0, 16, (4, 4))
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        learner.step(x.numel(), loss=loss.item())
        time.sleep(pause)
    return learner


def wide(seed, layers=1):
    """About 4.2 MB of fp32 per layer: two 2 MiB chunks at least, so a capped link takes a while."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(16, 1024), *(nn.Linear(1024, 1024) for _ in range(layers)))


def model_bytes(model) -> int:
    return sum(4 * p.numel() for p in model.parameters())


def params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@contextlib.contextmanager
def syncer_running(stall_timeout: float = 60.0, allow_takeover: bool = False, initial_model=None, **cfg):
    cfg = for_mode("decoupled", 2, **{"fragments": 2, "sync_every": 4, **cfg})
    syncer = SyncerThread(cfg, ServerOptions(listen="127.0.0.1:0", http=None, stall_timeout=stall_timeout,
                                             allow_takeover=allow_takeover, initial_model=initial_model))
    try:
        yield syncer
    finally:
        syncer.stop()


@contextlib.contextmanager
def proxy_to(address, **faults):
    proxy = ProxyThread(address, faults=LinkFaults(**faults))
    try:
        yield proxy
    finally:
        proxy.stop()


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "own_loop.py"


def train_two(cfg, steps: int):
    """The example as two learners, alice and bob, against a syncer with `cfg`: (their Learners, its final status)."""
    spec = importlib.util.spec_from_file_location("own_loop", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    syncer = SyncerThread(cfg, ServerOptions(listen="127.0.0.1:0", http=None))
    done = {}
    try:
        threads = [threading.Thread(target=lambda i=i: done.update({i: example.main(syncer.address, i, steps=steps)}))
                   for i in ("alice", "bob")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        status = syncer.stop()
    return done, status
