"""After warm-up a learner allocates next to nothing per step on the training thread (CPU, int4 pushes, keep-overlap:
the decoupled defaults): kept Δs are cut from one reused ring, and applies and staging reuse their chunk buffers."""


import pytest
import torch

from diloco import GrpcTransport, Learner, for_mode
from diloco.learner.staging import BufferRing
from diloco.options import model_config
from diloco.syncer.serving.server import ServerOptions, SyncerThread
from diloco.train.model import GPT

from benchmarks.learner.overhead import step_allocations


def test_a_warm_learner_allocates_under_a_kibibyte_a_step():
    torch.manual_seed(0)
    cfg = model_config("small")
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    syncer = SyncerThread(for_mode("decoupled", 1, fragments=8, sync_every=8), ServerOptions(listen="127.0.0.1:0", http=None))
    try:
        learner = Learner(model, GrpcTransport(syncer.address), "a")
        rows = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1))

        def train_step():
            _, loss = model(rows[:, :-1], rows[:, 1:])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        for _ in range(40):  # five cycles of the fragments: the ring and the chunk buffers have grown
            train_step()
            learner.step(4 * cfg.seq_len)
        counted = step_allocations(train_step, lambda: learner.step(4 * cfg.seq_len), 16)
        assert learner.applied >= 16
        fragment_bytes = 4 * sum(p.numel() for p in model.parameters()) / 8
        # before the ring and the reused buffers: about 4.5 fragments' fp32 bytes a step; before the scales of a
        # change were widened into the reused chunk buffer, its fp32 scales (a 64th of fragment_bytes, 6.6 KB) a step
        assert counted["bytes_per_step"] < min(fragment_bytes / 20, 1024), counted
        learner.finish(timeout=60)
    finally:
        syncer.stop()


def test_the_ring_is_reused_once_it_has_held_what_is_in_flight():
    ring = BufferRing(10_000)
    tokens = []
    for numel in (100, 300, 50, 100, 300, 50, 100, 300, 50):  # fragments of three sizes, two in flight at once
        tokens.append(ring.take(numel))
        if len(tokens) > 2:
            ring.give_back(tokens.pop(0)[1])
    grown = ring.allocations
    for numel in (100, 300, 50) * 10:
        view, token = ring.take(numel)
        assert view.numel() == numel
        tokens.append((view, token))
        ring.give_back(tokens.pop(0)[1])
    assert ring.allocations == grown


def test_spans_in_flight_never_overlap_and_one_given_back_late_holds_its_place():
    ring = BufferRing(10_000)
    held = {}
    for i in range(200):
        numel = (37 * i) % 120 + 1
        view, token = ring.take(numel)
        view.fill_(i)
        held[i] = (view, token, i)
        if i % 7 != 3 and i - 2 in held and held[i - 2][2] % 7 != 3:
            ring.give_back(held.pop(i - 2)[1])
        if i % 40 == 39:  # the late ones come back, out of order
            for j in [k for k in held if k % 7 == 3]:
                ring.give_back(held.pop(j)[1])
        for view, _, value in held.values():  # nothing in flight was overwritten by a later take
            assert torch.all(view == value)
    assert ring.allocations < 10


def test_a_span_given_back_from_a_replaced_ring_is_ignored():
    ring = BufferRing(10_000)
    first = ring.take(10)
    second = ring.take(1000)  # no room: a new ring; the first span's storage lives on in its view
    assert ring.allocations == 2
    ring.give_back(first[1])
    third = ring.take(10)
    assert third[0].data_ptr() != second[0].data_ptr()
    ring.give_back(second[1])
    ring.give_back(third[1])


def test_beyond_its_limit_a_delta_gets_a_buffer_of_its_own():
    ring = BufferRing(100)
    held = ring.take(80)
    own, token = ring.take(60)
    assert token is None and own.numel() == 60 and ring.buffer.numel() == 100
    ring.give_back(token)
    ring.give_back(held[1])
    assert ring.take(100)[0].data_ptr() == ring.buffer.data_ptr()


def test_spans_come_back_from_other_threads():
    import threading

    ring = BufferRing(1 << 16, torch.float32)
    grown = None
    for cycle in range(3):  # a cycle to grow, then no allocation
        taken = [ring.take(1000) for _ in range(8)]
        threads = [threading.Thread(target=ring.give_back, args=(token,)) for _, token in taken]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        grown = ring.allocations if cycle == 0 else grown
    assert not ring.lent and ring.allocations == grown and ring.buffer.dtype == torch.float32


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("device_codec", [False, True])
def test_a_warm_cuda_learner_pins_no_more_host_memory(device_codec):
    from diloco.learner import costs

    torch.manual_seed(0)
    model = GPT(model_config("small")).cuda()
    syncer = SyncerThread(for_mode("decoupled", 1, fragments=8, sync_every=8),
                          ServerOptions(listen="127.0.0.1:0", http=None))
    try:
        learner = Learner(model, GrpcTransport(syncer.address), "a", device_codec=device_codec)
        for step in range(80):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p), alpha=1e-4)
            learner.step(512)
            if step == 39:  # five cycles of the fragments: the pinned ring has grown
                pinned = costs.PINNED.total
        assert learner.pushes >= 70 and costs.PINNED.total == pinned
        learner.finish(timeout=60)
    finally:
        syncer.stop()
