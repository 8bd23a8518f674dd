"""A learner that vanishes without leaving is marked absent, stops no one, and rejoins under its id; learners
hear how much of the run's budget is spent."""

import threading
import time

import torch
from torch import nn

from diloco.config import for_mode
from diloco.algorithm.fragments import gather, plan_fragments, tensor_specs
from diloco.learner.grpc_transport import GrpcTransport
from diloco.learner.learner import Learner
from diloco.syncer.serving.server import ServerOptions, SyncerThread

from liveness import wait_for


def net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(16, 4), nn.Flatten(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 16))


def steps(learner, model, opt, n, position=0):
    g = torch.Generator().manual_seed(n)
    for i in range(n):
        x = torch.randint(0, 16, (4, 4), generator=g)
        loss = nn.functional.cross_entropy(model(x), x.sum(1) % 16)
        opt.zero_grad()
        loss.backward()
        opt.step()
        learner.step(16, loss=loss.item(), data_position=position + i + 1)
        time.sleep(0.005)


def learner_state(syncer, learner_id):
    return {x["id"]: x for x in syncer.status["learners"]}.get(learner_id, {})  # the status is refreshed periodically


def crash(learner):
    """What SIGKILL does to a learner, seen from the syncer: its connection ends without a Leave."""
    transport = learner.transport
    transport._closing.set()
    transport.channel.close()


def test_crashed_learner_is_absent_then_rejoins_with_global_model_and_data_position():
    cfg = for_mode("decoupled", 2, fragments=2, sync_every=4, heartbeat_seconds=0.1, absent_after_seconds=1.0)
    syncer = SyncerThread(cfg, ServerOptions(listen="127.0.0.1:0", http=None))
    try:
        ma, mb = net(), net()
        a = Learner(ma, GrpcTransport(syncer.address), "a")
        b = Learner(mb, GrpcTransport(syncer.address), "b")
        oa, ob = torch.optim.AdamW(ma.parameters(), 1e-2), torch.optim.AdamW(mb.parameters(), 1e-2)
        pushed = []  # the data position each of a's pushes carries
        send = a.transport.push
        a.transport.push = lambda job: (pushed.append(job.data_position), send(job))[1]
        steps(a, ma, oa, 40)
        steps(b, mb, ob, 8)
        # a's pushes are all merged. A push due while the one before is unanswered is skipped, so how far the last one
        # reached depends on how fast the syncer answered: the ledger must hold exactly what it carried
        assert pushed and pushed == sorted(pushed) and pushed[-1] <= 40
        wait_for(lambda: sum(syncer.status.get("pending", [1])) == 0
                 and learner_state(syncer, "a").get("data_position", 0) == pushed[-1])
        crash(a)
        wait_for(lambda: learner_state(syncer, "a").get("state") == "absent")
        rounds_before = syncer.status["rounds"]
        steps(b, mb, ob, 40)  # b alone keeps the global model advancing
        wait_for(lambda: syncer.status["rounds"] > rounds_before)
        states = {x["id"]: x for x in syncer.status["learners"]}
        assert states["a"]["state"] == "absent" and states["b"]["state"] == "live"
        assert syncer.status["rounds"] > rounds_before
        merged_a = states["a"]["merged"]

        fresh = net(seed=123)  # a restarted process: fresh weights, replaced on join by the global model
        a2 = Learner(fresh, GrpcTransport(syncer.address), "a")
        # the ledger's record of where a's merged data ended, read at the join
        recorded = syncer.service.core.learners["a"].data_position
        assert a2.data_position == recorded == pushed[-1]
        for frag, slot in zip(plan_fragments(tensor_specs(fresh), 2), a2.slots):
            assert torch.equal(gather(dict(fresh.named_parameters()), frag), slot.base)
        opt2 = torch.optim.AdamW(fresh.parameters(), 1e-2)
        steps(a2, fresh, opt2, cfg.sync_every, position=a2.data_position)  # one sync period
        wait_for(lambda: learner_state(syncer, "a").get("merged", 0) > merged_a)  # contributes again
        steps(a2, fresh, opt2, 16, position=a2.data_position)
        a2.finish()
        b.finish()
    finally:
        final = syncer.stop()
    states = {x["id"]: x for x in final["learners"]}
    assert states["a"]["merged"] > merged_a  # contributes again after rejoining


def test_learners_hear_how_much_of_the_budget_is_spent():
    cfg = for_mode("decoupled", 1, fragments=2, sync_every=4, heartbeat_seconds=0.1)
    syncer = SyncerThread(cfg, ServerOptions(listen="127.0.0.1:0", http=None, token_budget=16 * 100))
    try:
        model = net()
        learner = Learner(model, GrpcTransport(syncer.address), "a")
        assert learner.budget_progress is None  # nothing heard yet
        steps(learner, model, torch.optim.AdamW(model.parameters(), 1e-2), 25)  # 400 of 1600 tokens
        # progress is reported at most every heartbeat_seconds / 2 (here at most 10 steps of 5 ms apart), so what
        # the syncer heard is between step 15 and step 25
        wait_for(lambda: (learner.budget_progress or 0.0) >= 0.15)
        assert 0.15 <= learner.budget_progress <= 0.25
        learner.finish()
    finally:
        syncer.stop()


def test_a_learner_that_restarts_keeps_what_it_trained_in_the_runs_tokens_and_budget():
    cfg = for_mode("decoupled", 1, fragments=2, sync_every=4, heartbeat_seconds=0.1)
    syncer = SyncerThread(cfg, ServerOptions(listen="127.0.0.1:0", http=None, token_budget=16 * 100))
    core = syncer.service.core
    try:
        model = net()
        first = Learner(model, GrpcTransport(syncer.address), "a")
        steps(first, model, torch.optim.AdamW(model.parameters(), 1e-2), 25)  # 400 tokens, heard up to 240 or more
        wait_for(lambda: core.tokens_trained() >= 240 and (first.budget_progress or 0.0) >= 0.15)
        first.transport.close()  # the process dies: no leave, and its successor counts from 0
        heard, progress = core.tokens_trained(), core.budget_progress()
        model = net()
        again = Learner(model, GrpcTransport(syncer.address), "a")
        steps(again, model, torch.optim.AdamW(model.parameters(), 1e-2), 10)  # 160 tokens in its new session
        # the new session's count adds to the old one's, and the learner hears the budget from there on
        wait_for(lambda: core.tokens_trained() > heard and again.budget_progress is not None, timeout=30)
        assert core.budget_progress() >= progress and again.budget_progress >= progress
        again.finish()
    finally:
        syncer.stop()


def test_a_rejoined_learners_step_in_the_status_continues_from_its_earlier_sessions():
    cfg = for_mode("decoupled", 1, fragments=2, sync_every=4, heartbeat_seconds=0.1)
    syncer = SyncerThread(cfg, ServerOptions(listen="127.0.0.1:0", http=None))
    try:
        model = net()
        first = Learner(model, GrpcTransport(syncer.address), "a")
        steps(first, model, torch.optim.AdamW(model.parameters(), 1e-2), 12)
        first.finish()  # its last heartbeat has its count; its successor's own count starts at 0
        wait_for(lambda: learner_state(syncer, "a").get("step") == 12)
        model = net()
        again = Learner(model, GrpcTransport(syncer.address), "a")
        steps(again, model, torch.optim.AdamW(model.parameters(), 1e-2), 5)
        again.finish()
    finally:
        final = syncer.stop()
    assert {x["id"]: x for x in final["learners"]}["a"]["step"] == 17


def test_a_learner_joining_a_streaming_run_late_pushes_in_phase_and_nobody_waits_forever():
    # K = all and learners block on merges: a joiner that started its schedule at fragment 0 would wait for a merge
    # its peer never pushes towards, while the peer's round waits for it
    cfg = for_mode("streaming", 2, fragments=3, sync_every=6, heartbeat_seconds=0.1)
    syncer = SyncerThread(cfg, ServerOptions(listen="127.0.0.1:0", http=None))
    try:
        ma, mb = net(), net()
        a = Learner(ma, GrpcTransport(syncer.address), "a")
        oa, ob = torch.optim.AdamW(ma.parameters(), 1e-2), torch.optim.AdamW(mb.parameters(), 1e-2)
        steps(a, ma, oa, 9)  # alone: its last push was fragment 1 (offset 2) at step 8
        wait_for(lambda: a.transport.undelivered == 0, 120)  # the syncer has answered a's last push
        b = Learner(mb, GrpcTransport(syncer.address), "b")
        assert b.schedule_position == 2  # its first step is at position 3: it pushes what a pushes next
        done = []

        def train(learner, model, opt):
            steps(learner, model, opt, 18)
            done.append(learner.learner_id)

        threads = [threading.Thread(target=train, args=args, daemon=True) for args in ((a, ma, oa), (b, mb, ob))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert sorted(done) == ["a", "b"], "a learner is stuck waiting for a merge"
        wait_for(lambda: learner_state(syncer, "b").get("merged", 0) >= 6)  # b's pushes are merged with a's
        a.finish()
        b.finish()
    finally:
        syncer.stop()


def test_a_close_during_a_resubscribe_ends_the_receiver_quietly(monkeypatch):
    """close() may come between the receiver's check for closing and its next Subscribe (a starved thread, seen on a
    loaded machine): gRPC then raises ValueError ("Channel closed!"), which must end the loop, not print a traceback."""
    import diloco.learner.grpc_transport as grpc_transport

    syncer = SyncerThread(for_mode("decoupled", 1, fragments=2), ServerOptions(listen="127.0.0.1:0", http=None))
    try:
        model = net()
        learner = Learner(model, GrpcTransport(syncer.address), "a")
        transport = learner.transport
        learner.close()
        real = grpc_transport.Assembler

        def closed_meanwhile(*args, **kwargs):  # the loop passed its check; close() runs before it subscribes
            transport._closing.set()
            return real(*args, **kwargs)

        transport._closing.clear()
        monkeypatch.setattr(grpc_transport, "Assembler", closed_meanwhile)
        transport._receive_loop()  # returns; before, "ValueError: Cannot invoke RPC: Channel closed!"
    finally:
        syncer.stop()
