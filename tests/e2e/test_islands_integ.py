"""Learners that are torchrun jobs (islands): DDP ranks stay bit-identical through every apply, FSDP2 ranks take
their shards of the global model, and islands train beside plain learners."""

import importlib.util
import json
import pathlib
import socket
import subprocess
import sys
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from diloco import GrpcTransport, Learner, ServerOptions, SyncerThread, for_mode

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load(path: pathlib.Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: pathlib.Path, *args: str, ranks: int = 2) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), str(script), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finished(proc: subprocess.Popen, timeout: float = 120, result: pathlib.Path | None = None) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # torchrun stops its ranks on SIGTERM (they run in sessions of their own)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    # whether the result was written tells a crash in training from one at process exit
    assert proc.returncode == 0, f"result written: {result.exists() if result else '?'}\n{out[-3000:]}"
    return out


def plain_learner(example, address: str, steps: int) -> Learner:
    model = example.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    learner = Learner(model, GrpcTransport(address), "plain")
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        x = torch.randint(0, 64, (16, 8), generator=g)
        loss = nn.functional.cross_entropy(model(x), x.sum(dim=1) % 64)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        learner.step(x.numel(), loss=loss.item())
    learner.finish()
    return learner


@pytest.mark.slow
def test_two_ddp_islands_and_a_plain_learner_train_one_model(tmp_path):
    example = load(ROOT / "examples" / "torchrun_ddp.py", "torchrun_ddp")
    cfg = for_mode("decoupled", 3, fragments=3, sync_every=6)
    syncer = SyncerThread(cfg, ServerOptions(listen="127.0.0.1:0", http=None, out=tmp_path / "syncer"))
    try:
        islands = {name: torchrun(ROOT / "examples" / "torchrun_ddp.py", "--syncer", syncer.address, "--id", name,
                                  "--steps", "36", "--check-identical", "--summary", str(tmp_path / f"{name}.json"))
                   for name in ("island-a", "island-b")}
        done = {}
        plain = threading.Thread(target=lambda: done.update(plain=plain_learner(example, syncer.address, 36)))
        plain.start()
        for proc in islands.values():
            finished(proc)
        plain.join(120)
    finally:
        status = syncer.stop()
    for name in islands:
        summary = json.loads((tmp_path / f"{name}.json").read_text())
        assert summary["world"] == 2 and summary["mismatches"] == 0  # bit-identical ranks after every step
        assert summary["pushes"] >= 3 and summary["applied"] >= 1
        assert summary["tokens"] == 36 * 2 * 16 * 8  # both ranks' tokens count
    assert done["plain"].applied >= 1
    assert min(status["versions"][:cfg.fragments]) >= 1 and status["rounds"] >= 6
    learners = {x["id"]: x for x in status["learners"]}
    assert learners["island-a"]["merged"] >= 1 and learners["island-b"]["merged"] >= 1
    fresh = example.make_model()
    fresh.load_state_dict(load_file(tmp_path / "syncer" / "model.safetensors"), strict=True)


def test_an_fsdp2_island_takes_its_shards_of_the_global_model_and_trains(tmp_path):
    worker = load(ROOT / "tests" / "workers" / "fsdp_island.py", "fsdp_island")
    cfg = for_mode("decoupled", 2, fragments=3, sync_every=6)
    syncer = SyncerThread(cfg, ServerOptions(listen="127.0.0.1:0", http=None))
    try:
        first = worker.make_model(seed=0)  # sets the global model
        first_learner = Learner(first, GrpcTransport(syncer.address), "first")
        save_file({k: v.contiguous() for k, v in first.state_dict().items()}, tmp_path / "global.safetensors")
        proc = torchrun(ROOT / "tests" / "workers" / "fsdp_island.py", syncer.address, str(tmp_path / "out.json"),
                        str(tmp_path / "global.safetensors"))
        finished(proc, result=tmp_path / "out.json")
        first_learner.finish()
    finally:
        status = syncer.stop()
    seen = json.loads((tmp_path / "out.json").read_text())
    assert seen["joined_exactly"]
    assert seen["pushes"] >= 3 and seen["applied"] >= 1 and seen["tokens"] == 24 * 2 * 16 * 8
    assert {x["id"]: x for x in status["learners"]}["fsdp"]["merged"] >= 1
