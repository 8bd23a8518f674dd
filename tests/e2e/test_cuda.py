"""The CUDA path: fragments copied through pinned memory on a side stream, never a synchronising copy on the
training thread, bf16 and autocast. Needs an NVIDIA GPU: `python -m pytest -m cuda` runs only these; without a
GPU they are skipped and everything else passes."""

import pytest
import torch
from torch import nn

from diloco import Learner, LocalSyncer, LocalTransport, ServerOptions, SyncerThread, for_mode
from diloco.algorithm import codec
from diloco.learner.grpc_transport import GrpcTransport
from diloco.learner.staging import snapshot, to_device
from diloco.syncer.core import SyncerCore
from recording import Recording

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEVICE = torch.device("cuda", 0) if torch.cuda.is_available() else None


def net(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(32, 64), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32)).to(DEVICE, dtype)


def train_step(model, optimizer, autocast: bool = False) -> torch.Tensor:
    x = torch.randint(0, 32, (64,), device=DEVICE)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = nn.functional.cross_entropy(model(x).float(), x)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.detach()


def test_snapshots_reach_pinned_host_memory_and_values_come_back():
    tensors = [torch.randn(1000, device=DEVICE), torch.randn(10, 10, device=DEVICE, dtype=torch.bfloat16)]
    taken = snapshot(tensors)
    host = taken.host()
    assert host.is_pinned() and host.dtype == torch.float32 and taken.device_values.is_cuda
    expected = torch.cat([t.float().reshape(-1).cpu() for t in tensors])
    assert torch.equal(host, expected)
    back = to_device(host, DEVICE)
    torch.cuda.current_stream().synchronize()
    assert torch.equal(back.cpu(), expected)


def test_a_step_never_synchronises_the_training_thread_with_the_device():
    cfg = for_mode("decoupled", 1, fragments=2, sync_every=2, overlap=1)  # τ < H
    model = net()
    transport = Recording(cfg)
    learner = Learner(model, transport, "a")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(4):
        train_step(model, optimizer)
        torch.cuda.set_sync_debug_mode("error")  # any synchronising CUDA call in learner.step raises
        try:
            learner.step(64)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert len(transport.jobs) >= 2
    for job in transport.jobs:  # the sender thread's work: Δ from the host snapshot
        assert job.delta.device.type == "cpu" and torch.isfinite(job.delta).all()


def test_a_device_codec_learner_encodes_the_host_codec_s_bytes_without_synchronising():
    cfg = for_mode("decoupled", 1, fragments=2, sync_every=2, overlap=1, codec="int4")
    model = net()
    transport = Recording(cfg)
    learner = Learner(model, transport, "a", device_codec=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(6):
        train_step(model, optimizer)
        torch.cuda.set_sync_debug_mode("error")
        try:
            learner.step(64)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert len(transport.jobs) >= 3
    for job in transport.jobs:  # the sender thread's work, here on the test's thread
        assert job.device.local.device_values.is_cuda and job.device.base.is_cuda
        exact = job.device.delta()
        assert job.payload("int4") == codec.encode(exact, "int4")  # bitwise what the host codec makes of Δ
    assert learner._pinned is None and learner._encoded is not None and not learner._encoded.lent


@pytest.mark.parametrize("device_codec", [False, True])
@pytest.mark.parametrize("dtype,autocast", [(torch.float32, True), (torch.bfloat16, False)])
def test_two_cuda_learners_train_against_a_syncer(dtype, autocast, device_codec):
    cfg = for_mode("decoupled", 2, fragments=3, sync_every=6)
    syncer = SyncerThread(cfg, ServerOptions(listen="127.0.0.1:0", http=None))
    try:
        models = [net(dtype), net(dtype)]
        learners = [Learner(m, GrpcTransport(syncer.address), f"gpu-{i}", device_codec=device_codec)
                    for i, m in enumerate(models)]
        size = 4 * sum(p.numel() for p in models[0].parameters())
        assert learners[1].transport.bytes_received < size / 4  # built alike on the GPU: its digests matched
        optimizers = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in models]
        first = last = None
        for step in range(60):
            for m, o, learner in zip(models, optimizers, learners):
                loss = train_step(m, o, autocast)
                learner.step(64)
            first = loss.item() if first is None else first
            last = loss.item()
        for learner in learners:
            learner.finish()
    finally:
        status = syncer.stop()
    assert all(learner.applied >= 3 for learner in learners)
    assert all(s.base.dtype == torch.float32 and s.base.device.type == "cpu" for s in learners[0].slots)
    assert all(p.is_cuda and p.dtype == dtype for m in models for p in m.parameters())
    assert min(status["versions"][:cfg.fragments]) >= 1 and last < first


def test_the_in_process_transport_works_with_a_cuda_model():
    core = SyncerCore(for_mode("decoupled", 1, fragments=2, sync_every=2, overlap=1))
    model = net()
    learner = Learner(model, LocalTransport(LocalSyncer(core)), "a")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(8):
        train_step(model, optimizer)
        learner.step(64)
    assert learner.applied >= 3 and all(fs.outer_values().device.type == "cpu" for fs in core.fragments)
