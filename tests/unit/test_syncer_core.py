"""SyncerCore under a fake clock: membership, validation, rounds, staleness, idempotency, downlink."""

import struct

import pytest
import torch

from diloco.algorithm import codec
from diloco.config import for_mode
from diloco.algorithm.fragments import TensorSpec
from diloco.learner.transport import Receiver
from diloco.algorithm.outer import delayed_nesterov_step
from diloco.syncer.core import Refused, SyncerCore
from diloco.syncer.downlink import tensor_checksum
from cores import SPECS, make_core, push


def block_payload(name, numel, scale):
    """A well-formed int8/int4 payload (right size and checksum) whose first block scale is `scale`."""
    data = bytearray(codec.encode(torch.ones(numel), name).data)
    data[:2] = struct.pack("<h", torch.tensor([scale], dtype=torch.bfloat16).view(torch.int16).item())  # bf16
    return codec.Encoded(name, numel, bytes(data), codec.checksum(bytes(data)))


def test_join_refuses_a_different_model_naming_the_first_differing_tensor():
    core, _ = make_core()
    wrong = [SPECS[0], TensorSpec("w1", (3, 3), "float32"), SPECS[2]]
    with pytest.raises(Refused, match=r"tensor #1: expected w1 \[3, 2\] float32, got w1 \[3, 3\] float32"):
        core.join("a", wrong)


@pytest.mark.parametrize("mutate, reason", [
    (lambda p: codec.Encoded(p.codec, p.numel, p.data[:-4] + b"\0\0\0\0", p.checksum), "corrupt payload"),
    (lambda p: codec.encode(torch.full((p.numel,), float("nan")), "fp32"), "non-finite"),
    (lambda p: codec.encode(torch.zeros(p.numel + 1), "fp32"), "bad shape"),
    (lambda p: block_payload("int4", p.numel, float("nan")), "non-finite"),  # decided from the scales alone
    (lambda p: block_payload("int8", p.numel, 3e38), "non-finite"),  # finite scale, but 127 × it overflows
])
def test_bad_contributions_are_refused_and_never_merged(mutate, reason):
    core, _ = make_core()
    s = core.join("a", SPECS)
    n = core.fragments[1].fragment.numel
    bad = mutate(codec.encode(torch.ones(n), "fp32"))
    result = core.push("a", s, 1, 1, 0, 4, 400, bad)
    assert not result.accepted and reason in result.reason and result.resync
    assert core.fragments[1].pending == {} and core.poll() == [] and core.fragments[1].version == 0


def test_unknown_learner_stale_session_and_bad_fragment():
    core, _ = make_core()
    with pytest.raises(Refused, match="unknown learner or wrong session") as unknown:
        push(core, "ghost", "x", 1)
    s1 = core.join("a", SPECS)
    core.join("a", SPECS)  # re-join elsewhere: the first session is stale now
    with pytest.raises(Refused, match="unknown learner or wrong session") as stale:
        push(core, "a", s1, 1)
    assert str(unknown.value).replace("ghost", "a") == str(stale.value)  # which ids exist is not told
    s = core.learners["a"].session
    result = core.push("a", s, 1, 7, 0, 1, 1, codec.encode(torch.zeros(2), "fp32"))
    assert not result.accepted and "bad fragment" in result.reason


def test_k1_round_waits_grace_then_merges_token_weighted():
    core, clock = make_core(grace=1.0, outer_lr=0.7, outer_momentum=0.9)
    sa, sb = core.join("a", SPECS), core.join("b", SPECS)
    before = core.fragments[1].outer_values().clone()
    assert push(core, "a", sa, 1, value=1.0, tokens=300, steps=3).accepted
    assert core.poll() == []  # quorum of 1 reached, grace open: b may still come
    assert core.next_wakeup() == pytest.approx(101.0)
    clock.now += 0.5
    assert push(core, "b", sb, 1, value=1.0, tokens=100, steps=1).accepted
    pubs = core.poll()  # every live learner is in: closes early
    assert sorted(p.learner for p in pubs) == ["a", "b"] and core.fragments[1].version == 1
    assert core.learners["a"].tokens_merged == pytest.approx(300 / 3)
    # equal directions and norms: RDA gives Δ = 1 everywhere, first Nesterov step moves by η(1 + μ)
    lr, mu = core.cfg.outer_lr, core.cfg.outer_momentum
    assert torch.allclose(core.fragments[1].outer_values(), before - lr * (1 + mu))


def test_grace_window_end_closes_without_the_slow_learner():
    core, clock = make_core(grace=1.0)
    sa, _ = core.join("a", SPECS), core.join("b", SPECS)
    push(core, "a", sa, 1)
    assert core.poll() == []
    clock.now += 1.0
    assert [p.learner for p in core.poll()] == ["a"]


def test_round_waits_for_a_learner_whose_push_of_the_fragment_is_due_in_a_few_steps():
    # H = 6, P = 3: offsets 0, 2, 4. b pushed fragment 0 at t = 100, so fragment 1 is due two steps later.
    core, clock = make_core(grace=0.0, grace_expect_steps=3.0)
    sa, sb = core.join("a", SPECS), core.join("b", SPECS)
    for lid, s in (("a", sa), ("b", sb)):
        core.heartbeat(lid, s, step_seconds=1.0)
    push(core, "b", sb, 1, fragment=0)
    core.poll()
    clock.now = 101.0
    push(core, "a", sa, 2, fragment=1)
    assert core.poll() == [] and core.next_wakeup() == pytest.approx(102.5)
    clock.now = 102.4  # late by less than the policy's half-step margin: still awaited
    assert core.poll() == []
    push(core, "b", sb, 3, fragment=1)
    assert sorted(p.learner for p in core.poll()) == ["a", "b"]
    # fragment 0 (offset 0) is due for b 4 steps after its push of fragment 1 (offset 2): beyond 3, not awaited
    clock.now = 102.8
    push(core, "a", sa, 4, fragment=0)
    assert [p.learner for p in core.poll()] == ["a"]


def test_absent_learner_is_not_waited_for():
    core, clock = make_core(learners=2, quorum=1, grace=100.0)
    sa, _ = core.join("a", SPECS), core.join("b", SPECS)
    push(core, "a", sa, 1)
    assert core.poll() == []
    clock.now += core.cfg.absent_after_seconds + 0.1
    core.heartbeat("a", sa)
    assert core.live() == frozenset({"a"})
    assert len(core.poll()) == 1


def test_duplicate_push_is_merged_at_most_once():
    core, _ = make_core(grace=0.0)
    s = core.join("a", SPECS)
    core.join("b", SPECS)
    assert push(core, "a", s, 5).accepted
    again = push(core, "a", s, 5)
    assert again.accepted and again.duplicate
    assert core.fragments[1].pending["a"].tokens == 400


def test_a_second_push_from_a_pending_learner_closes_the_round_first():
    # no contribution's Δ is kept, so the older one cannot be taken out of the sums: it is merged on its own
    core, _ = make_core(grace=100.0, outer_momentum=0.0, outer_lr=1.0, scale_partial_rounds=False)
    s = core.join("a", SPECS)
    core.join("b", SPECS)
    before = core.fragments[1].outer_values().clone()
    push(core, "a", s, 1, value=1.0, steps=2, tokens=200)
    s2 = core.join("a", SPECS)  # a restarted process: its first session's contribution is still pending
    push(core, "a", s2, 1, value=3.0, steps=4, tokens=400)
    assert core.fragments[1].version == 1 and torch.allclose(core.fragments[1].outer_values(), before - 1.0)
    c = core.fragments[1].pending["a"]
    assert (c.session, c.steps, c.tokens, c.base_version) == (s2, 4, 400, 0)
    # the closed round answers no one: its push's session was replaced, and the new session holds v0, not the v0
    # the answer's change would start from (its seq 1 would also pass for the new session's own push 1)
    assert core.next_wakeup() > 100.0
    assert core.poll() == [] and core.fragments[1].pending  # the new round stays open for b
    assert core.learners["a"].merged_seq == {f"{s}:1": 1}
    pubs = core.poll(force=True)
    assert torch.allclose(core.fragments[1].outer_values(), before - 4.0) and core.fragments[1].version == 2
    (answer,) = pubs  # to the new session's own push 1, taking it from the v0 it holds to v2
    assert (answer.learner, answer.version, answer.seq, answer.full) == ("a", 2, 1, True)


def test_too_stale_contribution_is_refused_with_resync():
    core, _ = make_core(max_staleness=1, grace=0.0)
    sa, sb = core.join("a", SPECS), core.join("b", SPECS)
    core.leave("b", sb)
    for seq in (1, 2):
        push(core, "a", sa, seq)
        core.poll()
    assert core.fragments[1].version == 2
    result = push(core, "b", core.join("b", SPECS), 9, base_version=0)
    assert not result.accepted and result.resync and "version 0" in result.reason
    pub = core.resync("b", core.learners["b"].session, 1)
    assert pub.full and pub.version == 2


@pytest.mark.parametrize("down", ["int8", "int4", "bf16", "fp32"])
def test_downlink_changes_keep_learner_and_syncer_in_step(down):
    core, _ = make_core(learners=1, grace=0.0, down_codec=down)
    s = core.join("a", SPECS)
    receiver = Receiver()
    receiver.reset([(i, v, t.clone()) for i, v, t in core.snapshot_for_join("a")])  # the core updates its own copy in place
    g = torch.Generator().manual_seed(0)
    for seq in range(1, 8):
        n = core.fragments[1].fragment.numel
        core.push("a", s, seq, 1, core.fragments[1].version, 2, 200, codec.encode(torch.randn(n, generator=g), "fp32"))
        for pub in core.poll():
            assert receiver.accept(pub)
    held = receiver.drain(None)[-1].values
    assert torch.equal(held, core.fragments[1].values) and core.learners["a"].versions[1] == 7
    err = (held - core.fragments[1].outer_values()).abs().max().item()
    assert err == 0.0 if down == "fp32" else err < 0.5


@pytest.mark.parametrize("down", ["int8", "int4"])
def test_theta_kept_as_published_values_and_a_bf16_residual_tracks_the_fp32_theta(down):
    # the same pushes into a core with Θ in fp32 and one with Θ = P + bf16 residual: the learners' values are
    # the same change for change, and Θ differs by the residual's rounding alone
    cores = [make_core(learners=1, grace=0.0, down_codec=down, bf16_residual=b)[0] for b in (False, True)]
    sessions = [core.join("a", SPECS) for core in cores]
    g = torch.Generator().manual_seed(4)
    n = cores[0].fragments[1].fragment.numel
    for seq in range(1, 30):
        delta = codec.encode(torch.randn(n, generator=g) * 0.3, "fp32")
        for core, s in zip(cores, sessions):
            assert core.push("a", s, seq, 1, core.fragments[1].version, 2, 200, delta).accepted
            core.poll()
    exact, compact = cores[0].fragments[1], cores[1].fragments[1]
    assert compact.theta is None and compact.residual.dtype == torch.bfloat16 and exact.residual is None
    residual = compact.outer_values() - compact.values
    assert residual.abs().max() > 0  # the last change's quantisation error
    # the residual's bf16 rounding, 2^-9 of it per round at most, is all that separates the two Θ
    gap = (compact.outer_values() - exact.outer_values()).abs().max().item()
    assert gap <= 30 * 2 ** -8 * (exact.outer_values() - exact.values).abs().max().item() + 1e-6, gap
    # what learners hold stays within one quantisation error of Θ, as with Θ in fp32
    assert residual.abs().max() <= 2 * (exact.outer_values() - exact.values).abs().max()


def test_a_learner_behind_gets_the_chain_of_changes_it_missed_then_full_values():
    specs = [TensorSpec("emb", (64, 4), "float32", True), TensorSpec("w1", (64, 10), "float32"),
             TensorSpec("w2", (128,), "float32")]  # int8 changes of 640 values: about 1/4 of their fp32 size
    core, _ = make_core(learners=2, specs=specs, grace=0.0, quorum=1, down_codec="int8")
    assert core.fragments[1].fragment.numel == 640
    sa, sb = core.join("a", specs), core.join("b", specs)
    receivers = {lid: Receiver() for lid in "ab"}
    for lid in "ab":
        receivers[lid].reset(core.snapshot_for_join(lid))
    g = torch.Generator().manual_seed(1)
    n = core.fragments[1].fragment.numel

    def round_of(lid, session, seq):
        core.push(lid, session, seq, 1, core.fragments[1].version, 2, 200,
                  codec.encode(torch.randn(n, generator=g), "fp32"))
        pubs = core.poll(force=True)
        for pub in pubs:
            assert receivers[pub.learner].accept(pub)
        return pubs

    round_of("b", sb, 1)  # b at version 1, a still at 0
    pubs = round_of("a", sa, 1)  # a missed version 1: a chain of two
    assert [(p.version, p.full, p.seq) for p in pubs] == [(1, False, 0), (2, False, 1)]
    pubs = round_of("a", sa, 2)
    assert [(p.version, p.full, p.seq) for p in pubs] == [(3, False, 2)]
    for seq in (2, 3):
        round_of("a", sa, seq + 1)  # b falls 4 behind: longer than a chain smaller than full fp32 values
    assert core.full_answers == {"count": 0, "bytes": 0}
    pubs = round_of("b", sb, 2)
    assert [(p.version, p.full, p.seq) for p in pubs] == [(6, True, 2)]
    assert core.status()["full_answers"] == {"count": 1, "bytes": 4 * n}  # counted: each costs 4 bytes a value
    round_of("a", sa, 5)
    pubs = round_of("b", sb, 3)  # two behind: two int8 changes, only the last one is the answer
    assert [(p.version, p.full, p.seq) for p in pubs] == [(7, False, 0), (8, False, 3)]
    arrivals = receivers["b"].drain(None)
    assert [(a.version, a.seq) for a in arrivals][-2:] == [(7, 0), (8, 3)]
    assert torch.equal(receivers["b"].held[1], core.fragments[1].values) and core.learners["a"].versions[1] == 7
    # a holds 7 and b 8: only the change a misses is kept (4 int8 changes would be larger than full values anyway)
    assert [w for w, _, _ in core.fragments[1].changes] == [8]


def test_the_change_window_keeps_what_live_learners_miss_and_no_more():
    specs = [TensorSpec("emb", (64, 4), "float32", True), TensorSpec("w1", (64, 10), "float32"),
             TensorSpec("w2", (128,), "float32")]  # int8 changes of 640 values: about 1/4 of their fp32 size
    core, clock = make_core(learners=2, specs=specs, grace=0.0, quorum=1, down_codec="int8")
    sa, _ = core.join("a", specs), core.join("b", specs)
    n, g = core.fragments[1].fragment.numel, torch.Generator().manual_seed(2)
    for seq in range(1, 4):  # only a pushes: b, live, still holds version 0 and misses every change
        core.push("a", sa, seq, 1, core.fragments[1].version, 2, 200, codec.encode(torch.randn(n, generator=g), "fp32"))
        core.poll(force=True)
    assert [w for w, _, _ in core.fragments[1].changes] == [1, 2, 3]
    clock.now += core.cfg.absent_after_seconds + 1  # b is gone: on return it is sent full values
    core.heartbeat("a", sa, step=4)
    core.push("a", sa, 4, 1, core.fragments[1].version, 2, 200, codec.encode(torch.randn(n, generator=g), "fp32"))
    core.poll(force=True)
    assert [w for w, _, _ in core.fragments[1].changes] == []  # a holds version 4, the only live learner


def test_the_change_buffer_drops_the_oldest_changes_of_the_longest_window_and_a_learner_that_misses_one_gets_full_values():
    specs = [TensorSpec("emb", (64, 4), "float32", True), TensorSpec("w1", (64, 10), "float32"),
             TensorSpec("w2", (128,), "float32")]
    core, _ = make_core(learners=2, specs=specs, grace=0.0, quorum=1, down_codec="int8")
    sa, sb = core.join("a", specs), core.join("b", specs)
    g = torch.Generator().manual_seed(3)

    def round_of(lid, session, seq, fragment):
        n = core.fragments[fragment].fragment.numel
        core.push(lid, session, seq, fragment, core.fragments[fragment].version, 2, 200,
                  codec.encode(torch.randn(n, generator=g), "fp32"))
        return core.poll(force=True)

    for seq in (1, 2):  # b, live, lags on fragments 1 and 2: each keeps what it misses
        round_of("a", sa, 2 * seq - 1, 1)
        round_of("a", sa, 2 * seq, 2)
    kept = lambda i: [w for w, _, _ in core.fragments[i].changes]  # noqa: E731
    assert kept(1) == [1, 2] and kept(2) == [1, 2]
    one_change = len(core.fragments[1].changes[-1][1].data)  # 640 values in int8 and their scales
    model_bytes = 4 * sum(fs.fragment.numel for fs in core.fragments)
    # room for what is kept and half a change more: fragment 1's third round drops its own oldest change, not
    # fragment 2's smaller ones
    core.change_buffer = (2.5 * one_change + 2 * len(core.fragments[2].changes[-1][1].data)) / model_bytes
    round_of("a", sa, 5, 1)
    assert kept(1) == [2, 3] and kept(2) == [1, 2]
    assert core.status()["full_answers"]["count"] == 0
    pubs = round_of("b", sb, 1, 1)  # b holds version 0 of fragment 1, whose first change is gone: full values
    assert [(p.version, p.full) for p in pubs] == [(4, True)]
    pubs = round_of("b", sb, 2, 2)  # fragment 2's chain is whole: changes
    assert [(p.version, p.full) for p in pubs] == [(1, False), (2, False), (3, False)]


@pytest.mark.parametrize("publish_to,down_codec", [("contributors", "int8"), ("live", "fp32")])
def test_a_learners_last_push_of_a_fragment_gets_no_answer_and_keeps_no_change(publish_to, down_codec):
    specs = [TensorSpec("emb", (64, 4), "float32", True), TensorSpec("w1", (64, 10), "float32"),
             TensorSpec("w2", (128,), "float32")]  # room for a chain of int8 changes within a fragment's fp32 size
    core, _ = make_core(learners=2, specs=specs, grace=0.0, quorum=1, down_codec=down_codec, publish_to=publish_to)
    sa, sb = core.join("a", specs), core.join("b", specs)
    n = core.fragments[1].fragment.numel
    g = torch.Generator().manual_seed(5)

    def round_of(lid, session, seq, final=False):
        core.push(lid, session, seq, 1, core.fragments[1].version, 2, 200,
                  codec.encode(torch.randn(n, generator=g), "fp32"), final=final)
        return core.poll(force=True)

    receivers = lambda pubs: {p.learner for p in pubs}  # noqa: E731
    assert receivers(round_of("a", sa, 1)) == ({"a", "b"} if publish_to == "live" else {"a"})
    # b's training ended: its last push gets no answer (a, live, still gets the result unasked), nor a later result
    assert receivers(round_of("b", sb, 1, final=True)) == ({"a"} if publish_to == "live" else set())
    assert receivers(round_of("a", sa, 2)) == {"a"}
    assert 1 in core.learners["b"].finished and 1 not in core.learners["b"].versions
    # b, still live, held version 0 (int8 changes): its old version no longer keeps the changes since
    assert [w for w, _, _ in core.fragments[1].changes] == []
    assert core.status()["full_answers"]["count"] == (0 if down_codec == "int8" else 4)
    pubs = round_of("b", sb, 2)  # a push that is not its last after all: the fragment's full values
    assert [(p.learner, p.full) for p in pubs if p.learner == "b"] == [("b", True)]
    assert 1 not in core.learners["b"].finished
    round_of("a", sa, 3, final=True)
    round_of("b", sb, 3, final=True)  # both live learners finished the fragment: no change is kept for anyone
    assert [w for w, _, _ in core.fragments[1].changes] == []


THREE = [TensorSpec("emb", (64, 4), "float32", True), TensorSpec("w1", (64, 10), "float32"),
         TensorSpec("w2", (128,), "float32")]
"""Three tensors, a fragment each."""


def random_pushes(core, seed):
    """push_to(learner, session, seq, fragment, final=False): a random Δ of 2 steps and 200 tokens on the current
    version."""
    g = torch.Generator().manual_seed(seed)

    def push_to(lid, session, seq, index, final=False):
        fs = core.fragments[index]
        core.push(lid, session, seq, index, fs.version, 2, 200,
                  codec.encode(torch.randn(fs.fragment.numel, generator=g), "fp32"), final=final)
    return push_to


@pytest.mark.parametrize("publish_to,down_codec", [("contributors", "int8"), ("live", "fp32")])
def test_a_learners_last_push_ends_every_fragment_it_has_no_push_waiting_in(publish_to, down_codec):
    # its training ended: it reads no result of any fragment again, so the other fragments' changes are not kept
    # for the version it held while the others flush, and none is published to it; a push still waiting is answered
    core, _ = make_core(learners=3, specs=THREE, grace=0.0, quorum=1, down_codec=down_codec, publish_to=publish_to)
    sa, sb, sc = (core.join(lid, THREE) for lid in "abc")
    push_to = random_pushes(core, seed=7)

    push_to("a", sa, 1, 1, final=True)  # a's last push: its training ended
    core.poll(force=True)
    assert core.learners["a"].finished == {0, 1, 2} and core.learners["a"].versions == {}
    push_to("c", sc, 1, 2)  # c's push of fragment 2 waits for an answer when its last push of fragment 0 is merged
    push_to("c", sc, 2, 0, final=True)
    pubs = core.poll(force=True)  # rounds close in fragment order: 0, then 2
    assert core.learners["c"].finished == {0, 1}
    # answered from what it held (a change, where changes go down)
    assert [(p.learner, p.full) for p in pubs if p.fragment == 2 and p.learner == "c"] == [("c", down_codec == "fp32")]
    push_to("b", sb, 1, 1)
    pubs = core.poll(force=True)
    # b, the one learner still training fragment 1, takes its result: a and c held old versions of it, which keep
    # no change alive, and get none
    assert {p.learner for p in pubs} == {"b"}
    assert [w for w, _, _ in core.fragments[1].changes] == []


def test_a_learners_last_push_ends_every_fragment_when_it_arrives_not_when_its_round_closes():
    # its training ended: while its own last rounds wait for a quorum, the rounds the others close keep no change
    # for the versions it held, and none of them is published to it
    core, _ = make_core(learners=3, specs=THREE, grace=0.0, quorum=2, down_codec="int8")
    sa, sb, sc = (core.join(lid, THREE) for lid in "abc")
    push_to = random_pushes(core, seed=3)

    push_to("a", sa, 1, 1, final=True)
    assert core.learners["a"].finished == {0, 1, 2} and core.learners["a"].versions == {}
    assert core.poll() == [] and "a" in core.fragments[1].pending  # a quorum of 2: its round stays open
    push_to("b", sb, 1, 0)
    push_to("c", sc, 1, 0)
    pubs = core.poll()
    assert core.fragments[0].version == 1 and "a" not in {p.learner for p in pubs}
    assert [w for w, _, _ in core.fragments[0].changes] == []  # b and c hold version 1; a reads nothing more


def test_a_chain_link_is_never_applied_as_an_answer():
    from diloco.learner.learner import Learner
    from diloco.inprocess import LocalSyncer, LocalTransport

    cfg = for_mode("decoupled", 2, fragments=1, sync_every=1, overlap=0, codec="fp32", down_codec="int8", grace=0.0)
    # a clock that stands still: which rounds each push lands in must not depend on how busy the machine is
    local = LocalSyncer(SyncerCore(cfg, clock=lambda: 0.0))
    models = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]
    learners = [Learner(m, LocalTransport(local), f"l{i}") for i, m in enumerate(models)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    for step in range(6):
        for i in ([0, 0, 1] if step % 2 else [0]):  # l1 pushes every other step: chains of two reach it
            opts[i].zero_grad()
            models[i](torch.ones(1, 4)).sum().backward()
            opts[i].step()
            learners[i].step(10)
    core, l1 = local.core, learners[1]
    assert l1.applied == l1.pushes and core.learners["l1"].versions[0] == core.fragments[0].version
    assert torch.equal(local.receivers["l1"].held[0], core.fragments[0].values)


def test_join_resync_and_restart_send_the_published_values_in_full(tmp_path):
    from diloco.syncer.at_rest.store import StateStore

    core, _ = make_core(learners=1, grace=0.0, down_codec="int4")
    core.store = StateStore(tmp_path)
    core.persist(range(len(core.fragments)))
    s = core.join("a", SPECS)
    for seq in (1, 2):
        push(core, "a", s, seq, value=0.3)
        core.poll()
    fs = core.fragments[1]
    assert not torch.equal(fs.values, fs.outer_values())  # int4 changes: the learners hold P, not Θ
    core.join("b", SPECS)
    snapshot = dict((i, v) for i, _, v in core.snapshot_for_join("b"))
    assert torch.equal(snapshot[1], fs.values)
    pub = core.resync("a", s, 1)
    assert pub.full and pub.result_checksum == tensor_checksum(fs.values)
    again, _ = make_core(learners=1, grace=0.0, down_codec="int4")
    again.store = StateStore(tmp_path)
    assert again.restore() and again.learners["a"].versions == {}
    push(again, "a", s, 3, value=0.3)
    (pub,) = again.poll()  # what a learner holds is unknown after a restart: full values
    assert pub.full and pub.result_checksum == tensor_checksum(again.fragments[1].values)


def test_token_budget_and_duration_stop_the_run():
    core, clock = make_core()
    core.token_budget = 1000
    s = core.join("a", SPECS)
    assert not core.heartbeat("a", s, tokens_trained=1000)  # a claim no push carried spends nothing
    for fragment in range(3):  # every token trains every fragment: 1000 tokens carried
        assert push(core, "a", s, 1 + fragment, fragment=fragment, tokens=1000).accepted
    assert not core.heartbeat("a", s, tokens_trained=999)
    assert core.heartbeat("a", s, tokens_trained=1000)
    core2, clock2 = make_core()
    core2.duration = 5.0
    s2 = core2.join("a", SPECS)
    clock2.now += 30.0  # start-up (building the model, the first batch) is not training time
    assert not core2.heartbeat("a", s2, tokens_trained=0)
    assert not core2.heartbeat("a", s2, tokens_trained=8)  # the first step: the duration starts here
    clock2.now += 4.9
    assert not core2.heartbeat("a", s2, tokens_trained=16)
    clock2.now += 0.1
    assert core2.heartbeat("a", s2, tokens_trained=24)


def test_budget_progress_is_the_larger_share_of_tokens_or_time_spent():
    core, clock = make_core()
    assert core.budget_progress() is None  # no budget: learners keep a constant learning rate
    core.token_budget = 1000
    s = core.join("a", SPECS)
    for fragment in range(3):
        assert push(core, "a", s, 1 + fragment, fragment=fragment, tokens=3000).accepted
    core.heartbeat("a", s, tokens_trained=250)
    assert core.budget_progress() == 0.25
    core.duration = 10.0
    clock.now += 5.0
    assert core.budget_progress() == 0.5
    core.heartbeat("a", s, tokens_trained=2000)
    assert core.budget_progress() == 1.0  # never past the end


def test_partial_round_is_scaled_by_its_share_of_expected_tokens():
    core, clock = make_core(learners=4, grace=0.0, outer_momentum=0.0, outer_lr=1.0)
    sessions = {x: core.join(x, SPECS) for x in "abcd"}
    before = core.fragments[1].outer_values().clone()
    push(core, "a", sessions["a"], 1, value=1.0, tokens=400)
    core.poll()  # a alone, three live learners missing with unknown typical size: share 1/4
    assert torch.allclose(core.fragments[1].outer_values(), before - 0.25)
    for x in "bcd":
        push(core, x, sessions[x], 1, value=1.0, tokens=400)
    core.poll()  # b, c, d: share 3/4, so the two rounds together make exactly one full step
    assert torch.allclose(core.fragments[1].outer_values(), before - 1.0, atol=1e-6)
    after = core.fragments[1].outer_values().clone()
    for seq, x in enumerate("abcd", start=2):
        push(core, x, sessions[x], seq, value=1.0, tokens=400)
    core.poll()  # everyone live in one round: no scaling
    assert torch.allclose(core.fragments[1].outer_values(), after - 1.0, atol=1e-6)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_outer_state_is_kept_only_when_momentum_can_move_theta(momentum):
    # μ = 0, decoupled mode's default: (delayed) Nesterov is Θ ← Θ − η·Δ, and neither v nor the pending Σ is held
    # Θ in fp32 (no bf16 residual): the outer step compared exactly
    core, clock = make_core(learners=2, grace=0.0, outer_momentum=momentum, outer_lr=0.7, bf16_residual=False)
    sessions = {x: core.join(x, SPECS) for x in "ab"}
    theta = core.fragments[1].outer_values().clone()
    v, pending, pending_share = torch.zeros_like(theta), torch.zeros_like(theta), 0.0
    for seq, (who, value) in enumerate([("a", 1.0), ("b", 0.5), ("a", 0.25)], start=1):
        push(core, who, sessions[who], seq, value=value, tokens=400)
        core.poll()  # one learner of two: a partial round, share 1/2
        pending_share = delayed_nesterov_step(theta, torch.full_like(theta, value / 2), v, pending, 0.5,
                                              pending_share, 0.7, momentum)
    fs = core.fragments[1]
    assert torch.equal(fs.outer_values(), theta)
    assert (fs.momentum.numel() == 0 and fs.pending_delta is None) == (momentum == 0.0)


def test_a_long_contribution_counts_as_h_steps_in_the_share():
    core, clock = make_core(learners=4, grace=0.0, outer_momentum=0.0, outer_lr=1.0)
    sessions = {x: core.join(x, SPECS) for x in "abcd"}
    for x in "bcd":  # the others' typical contribution: 4 steps, 400 tokens (a Δ of zero would count for none)
        push(core, x, sessions[x], 1, value=1e-6, steps=4, tokens=400)
        core.poll()
    before = core.fragments[1].outer_values().clone()
    # a, cut off for 60 steps, returns with all of them from one old base: it counts as H = 6 steps (600 tokens)
    push(core, "a", sessions["a"], 1, value=1.0, steps=60, tokens=6000)
    core.poll()
    assert torch.allclose(core.fragments[1].outer_values(), before - 600 / (600 + 3 * 400), atol=1e-6)
    assert core.learners["a"].tokens_merged == 6000 / 3  # all its work reached the model (per fragment of 3)


def test_scaling_can_be_disabled():
    core, _ = make_core(learners=2, grace=0.0, outer_momentum=0.0, outer_lr=1.0, scale_partial_rounds=False)
    sa, _ = core.join("a", SPECS), core.join("b", SPECS)
    before = core.fragments[1].outer_values().clone()
    push(core, "a", sa, 1, value=1.0)
    core.poll()
    assert torch.allclose(core.fragments[1].outer_values(), before - 1.0, atol=1e-6)


def test_a_huge_first_push_is_refused_by_the_ceiling_relative_to_the_fragment():
    core, _ = make_core(grace=0.0)
    s = core.join("a", SPECS)
    # fragment 1 holds 0..5 (norm 7.4): a push of v everywhere over 4 steps is 0.61·v per step
    result = push(core, "a", s, 1, value=20.0)
    assert not result.accepted and result.resync and "norm over ceiling" in result.reason
    assert core.refusals["norm over ceiling"] == 1 and core.fragments[1].pending == {}
    # declaring more steps buys an allowance only up to 2·H steps
    assert not push(core, "a", s, 2, value=20.0 * 3, steps=10**6).accepted
    assert push(core, "a", s, 3, value=10.0).accepted


def test_a_fragment_near_zero_gets_a_ceiling_all_the_same():
    core, _ = make_core(grace=0.0)
    core.fragments[1].theta.zero_()  # a zero-initialised layer
    s = core.join("a", SPECS)
    assert push(core, "a", s, 1, value=0.01).accepted
    assert "norm over ceiling" in push(core, "a", s, 2, value=1.0).reason


def feed(core, learners: dict[str, str], value: float, rounds: int, seq: dict[str, int]) -> None:
    for _ in range(rounds):
        for lid, session in learners.items():
            seq[lid] = seq.get(lid, 0) + 1
            assert push(core, lid, session, seq[lid], value=value).accepted
            core.poll()


def test_norm_outlier_against_accepted_contributions_is_refused_and_counted():
    core, _ = make_core(grace=0.0, norm_ceiling=0.0)
    s = core.join("a", SPECS)
    seq = {}
    feed(core, {"a": s}, 0.5, 4, seq)
    result = push(core, "a", s, 5, value=0.5 * 60)
    assert not result.accepted and result.resync and "norm outlier" in result.reason
    assert core.refusals["norm outlier"] == 1 and core.fragments[1].pending == {}
    assert push(core, "a", s, 6, value=0.6).accepted


def test_refused_pushes_do_not_raise_the_reference():
    core, _ = make_core(learners=3, grace=0.0, norm_ceiling=0.0)
    honest, attacker = {"a": core.join("a", SPECS)}, core.join("x", SPECS)
    seq = {}
    feed(core, honest, 0.5, 4, seq)
    for i in range(1, 60):  # 59 refused pushes at 40× ... 1000×
        assert not push(core, "x", attacker, i, value=0.5 * (40 + 16 * i)).accepted
    assert not push(core, "x", attacker, 60, value=0.5 * 60).accepted


def test_zero_norm_phases_do_not_collapse_the_reference():
    core, _ = make_core(grace=0.0, norm_ceiling=0.0)
    s = core.join("a", SPECS)
    seq = {}
    feed(core, {"a": s}, 0.5, 4, seq)
    feed(core, {"a": s}, 0.0, 40, seq)  # a frozen body: Δ = 0 for longer than the history
    seq["a"] += 1
    assert push(core, "a", s, seq["a"], value=0.5).accepted


def test_most_learners_moving_together_move_the_reference_and_a_lone_outlier_does_not():
    core, _ = make_core(learners=3, grace=0.0, norm_ceiling=0.0)
    learners = {lid: core.join(lid, SPECS) for lid in ("a", "b", "c")}
    seq = {}
    feed(core, learners, 1e-4, 4, seq)  # a near-frozen phase
    # one learner alone at 100×: refused, again and again
    for _ in range(3):
        seq["c"] += 1
        assert "norm outlier" in push(core, "c", learners["c"], seq["c"], value=1e-2).reason
    # a second learner at 100× makes two of three: the population moved, and both are merged from here on
    seq["a"] += 1
    assert push(core, "a", learners["a"], seq["a"], value=1e-2).accepted
    core.poll()
    feed(core, learners, 1e-2, 2, seq)


@pytest.mark.parametrize("bad", ["", "-x", "a b", "ü", "x" * 65, "a/b"])
def test_invalid_learner_ids_are_refused(bad):
    core, _ = make_core()
    with pytest.raises(Refused, match="invalid learner id"):
        core.join(bad, SPECS)


def test_payload_limit_matches_the_codec_size():
    core, _ = make_core()
    n = core.fragments[2].fragment.numel
    assert core.payload_limit(2, "int4") == codec.encoded_size(n, "int4")
    assert core.payload_limit(99, "int4") == 0
    with pytest.raises(ValueError, match="unknown codec"):
        core.payload_limit(2, "int3")


def test_contribution_from_a_long_disconnection_is_refused_with_resync():
    core, _ = make_core(max_steps_ratio=4.0)  # H = 6: more than 4·H = 24 local steps is too long
    s = core.join("a", SPECS)
    n = core.fragments[1].fragment.numel
    result = core.push("a", s, 1, 1, 0, 25, 2500, codec.encode(torch.zeros(n), "fp32"))
    assert not result.accepted and result.resync and "too long unsynchronised" in result.reason
    assert core.push("a", s, 2, 1, 0, 24, 2400, codec.encode(torch.zeros(n), "fp32")).accepted


def test_phase_lead_is_measured_against_the_longest_running_peer_of_similar_speed():
    # H = 6, P = 3 (offsets 0, 2, 4): a learner's position is its last push's offset plus the steps since
    core, clock = make_core(learners=3)
    sessions = {}
    for lid in "abc":
        sessions[lid] = core.join(lid, SPECS)
        clock.now += 0.1
    for lid, seconds in (("a", 1.0), ("b", 1.0), ("c", 3.0)):
        core.heartbeat(lid, sessions[lid], step_seconds=seconds)
    assert core.phase_lead("b") is None  # nobody has pushed yet
    clock.now = 100.0
    push(core, "a", sessions["a"], 1, fragment=0)
    clock.now = 101.0
    push(core, "b", sessions["b"], 1, fragment=0)
    push(core, "c", sessions["c"], 1, fragment=2)  # three times slower: nobody's peer, its own reference
    assert core.phase_lead("a") is None  # a joined first: the reference, never moved
    assert core.phase_lead("b") == pytest.approx(-1.0) and core.phase_lead("c") is None
    # circular over H: b at 0.5 (just past its wrap) and a at 5.5 means b is one step ahead
    clock.now = 103.5
    push(core, "a", sessions["a"], 2, fragment=2)
    clock.now = 104.5
    push(core, "b", sessions["b"], 2, fragment=0)
    clock.now = 105.0
    assert core.phase_lead("b") == pytest.approx(1.0)
    # a rejoins: b is now the longest-running, and a follows it
    sessions["a"] = core.join("a", SPECS)
    push(core, "a", sessions["a"], 1, fragment=1)
    assert core.phase_lead("b") is None and core.phase_lead("a") == pytest.approx(2.0 - 0.5)
    # a learner that stopped pushing (hung) is nobody's reference
    clock.now = 110.0
    push(core, "a", sessions["a"], 2, fragment=0)
    assert core.phase_lead("a") is None


def test_departed_learners_are_forgotten_after_a_while_and_beyond_a_cap(monkeypatch):
    core, clock = make_core(grace=0.0, absent_after_seconds=10.0, forget_after_seconds=100.0)
    sa, sb = core.join("a", SPECS), core.join("b", SPECS)
    assert push(core, "b", sb, 1).accepted  # pending in an open round until the next poll
    core.leave("a", sa)
    clock.now += 50
    assert core.expire() == [] and set(core.learners) == {"a", "b"}
    clock.now += 60  # both departed over 100 s ago; b is still waited on by its round
    assert core.expire() == ["a"] and set(core.learners) == {"b"}
    core.poll(force=True)
    assert core.expire() == ["b"] and core.learners == {}
    # an id flood: only the newest DEPARTED_KEPT departed records stay
    monkeypatch.setattr("diloco.syncer.membership.DEPARTED_KEPT", 3)
    for i in range(5):
        core.leave(f"x{i}", core.join(f"x{i}", SPECS))
        clock.now += 1
    assert core.expire() == ["x0", "x1"] and set(core.learners) == {"x2", "x3", "x4"}
    live = core.join("x0", SPECS)  # a forgotten id joins afresh
    assert core.learners["x0"].session == live and core.learners["x0"].data_position == 0


def test_a_restarted_learner_counts_from_zero_and_what_it_trained_before_still_counts(tmp_path):
    from diloco.syncer.at_rest.store import StateStore

    core, _ = make_core()
    core.token_budget = 3000
    core.store = StateStore(tmp_path)
    first = core.join("a", SPECS)
    for fragment in range(3):  # every token trains every fragment: 1000 tokens carried
        assert push(core, "a", first, 1 + fragment, fragment=fragment, tokens=1000).accepted
    assert not core.heartbeat("a", first, tokens_trained=1000)
    assert core.tokens_trained() == core.budget_tokens() == 1000
    again = core.join("a", SPECS)  # the process restarted: its count begins at 0 in its new session
    core.heartbeat("a", again, tokens_trained=200)
    assert core.tokens_trained() == 1200 and core.budget_tokens() == 1200  # not 200: the budget never goes back
    assert core.status()["learners"][0]["tokens"] == 1200
    for fragment in range(3):
        assert push(core, "a", again, 1 + fragment, fragment=fragment, tokens=1800).accepted
    assert core.heartbeat("a", again, tokens_trained=2000)  # 1000 + 2000 spend the budget of 3000
    core.poll(force=True)
    core.persist(range(len(core.fragments)))
    resumed, _ = make_core()  # the syncer restarted: the session goes on counting from where it was
    resumed.store, resumed.token_budget = StateStore(tmp_path), 3000
    assert resumed.restore() and resumed.tokens_trained() == 3000
    resumed.heartbeat("a", again, tokens_trained=2100)
    assert resumed.tokens_trained() == 3100


def test_forgotten_learners_tokens_still_count_in_the_budget_and_across_a_restart(tmp_path):
    from diloco.syncer.at_rest.store import StateStore

    core, clock = make_core(absent_after_seconds=10.0, forget_after_seconds=100.0)
    core.token_budget = 10_000
    core.store = StateStore(tmp_path)
    for name in ("a", "b"):
        session = core.join(name, SPECS)
        for fragment in range(3):
            assert push(core, name, session, 1 + fragment, fragment=fragment, tokens=1000).accepted
        core.heartbeat(name, session, tokens_trained=1000)
    core.poll(force=True)
    merged = core.tokens_merged()
    assert core.tokens_trained() == core.budget_tokens() == 2000 and merged > 0
    clock.now += 200
    assert core.expire() == ["a", "b"] and core.learners == {}
    assert (core.tokens_trained(), core.budget_tokens(), core.tokens_merged()) == (2000, 2000, merged)
    core.persist([])
    resumed, _ = make_core(absent_after_seconds=10.0, forget_after_seconds=100.0)
    resumed.store = StateStore(tmp_path)
    assert resumed.restore()
    assert (resumed.tokens_trained(), resumed.budget_tokens(), resumed.tokens_merged()) == (2000, 2000, merged)
    from diloco.syncer import persistence
    from diloco.syncer.at_rest.store import Damaged

    for bad in ({"trained": -1, "budget": 0, "merged": 0}, {"trained": 0, "budget": float("nan"), "merged": 0},
                {"trained": 0, "budget": float("inf"), "merged": 0}, {"trained": True, "budget": 0, "merged": 0},
                {"trained": 0}, [0, 0, 0]):
        with pytest.raises(Damaged, match="departed_tokens is not three token counts"):
            persistence._departed(bad, "ledger-00000001.json")


def test_publishing_to_live_learners_sends_the_round_unasked_to_those_that_did_not_push():
    core, clock = make_core(learners=3, grace=0.0, publish_to="live", down_codec="fp32")
    sa = core.join("a", SPECS)
    core.join("b", SPECS)
    core.leave("c", core.join("c", SPECS))  # gone: not live
    assert push(core, "a", sa, 1).accepted
    pubs = core.poll()
    assert sorted((p.learner, p.seq, p.full) for p in pubs) == [("a", 1, True), ("b", 0, True)]
    assert core.learners["b"].versions[1] == core.fragments[1].version


def test_synchronous_rounds_go_on_without_a_learner_absent_past_the_timeout():
    core, clock = make_core(learners=3, quorum=3)  # K = all, as in the synchronous modes
    sessions = {lid: core.join(lid, SPECS) for lid in "abc"}
    assert core.cfg.quorum == 3
    for lid in "ab":
        assert push(core, lid, sessions[lid], 1, fragment=0).accepted
    assert core.poll() == []  # c is live: a quorum of all waits for it
    clock.now += core.cfg.absent_after_seconds + 1  # c was killed: silent past the absence timeout
    for lid in "ab":
        core.heartbeat(lid, sessions[lid], step=1)
    assert {p.learner for p in core.poll()} == {"a", "b"}  # the survivors' round closed


def test_a_learner_rejoining_a_synchronous_run_starts_in_phase_and_open_rounds_do_not_wait_for_it():
    # streaming: P = 3 fragments over H = 6 steps (offsets 0, 2, 4), K = all, learners block on merges
    core, clock = make_core(learners=3, quorum=3, wait_for_merge=True)
    sessions = {lid: core.join(lid, SPECS) for lid in "abc"}
    assert all(core.learners[lid].start_position is None for lid in "abc")  # nobody had pushed
    clock.now += core.cfg.absent_after_seconds + 1  # c was killed; the survivors go on without it
    for lid in "ab":
        core.heartbeat(lid, sessions[lid], step=1)
        assert push(core, lid, sessions[lid], 1, fragment=0).accepted
    assert {p.learner for p in core.poll()} == {"a", "b"}
    clock.now += 1
    assert push(core, "a", sessions["a"], 2, fragment=1).accepted  # round of fragment 1 opens without c
    clock.now += 0.5
    sessions["c"] = core.join("c", SPECS)  # c restarts and rejoins while that round is open
    # its schedule starts after the latest push of its peers (fragment 1, offset 2): it next pushes fragment 2
    assert core.learners["c"].start_position == 3
    assert core.poll() == []  # still waits for b, which was there when the round opened ...
    assert push(core, "b", sessions["b"], 2, fragment=1).accepted
    assert {p.learner for p in core.poll()} == {"a", "b"}  # ... but not for c, which will not push fragment 1 now
    for lid in "ab":
        assert push(core, lid, sessions[lid], 3, fragment=2).accepted
    assert core.poll() == []  # the next fragment's round waits for c too ...
    assert push(core, "c", sessions["c"], 1, fragment=2).accepted
    assert {p.learner for p in core.poll()} == {"a", "b", "c"}  # ... and closes with all three


def test_a_joiner_starts_after_the_most_advanced_peer_not_the_latest_push():
    # a leads and has opened fragment 1's round; b, a fragment behind, pushes fragment 0 after it. A joiner that
    # started after b's push would push fragment 1 alone, once its round has closed, and block on a merge that
    # its peers reach only a period later while they wait for it on fragment 2
    core, clock = make_core(learners=3, quorum=3, wait_for_merge=True)
    sessions = {lid: core.join(lid, SPECS) for lid in "ab"}
    assert push(core, "a", sessions["a"], 1, fragment=0).accepted
    clock.now += 0.1
    assert push(core, "a", sessions["a"], 2, fragment=1).accepted
    clock.now += 0.1
    assert push(core, "b", sessions["b"], 1, fragment=0).accepted  # the latest push, but behind a's
    clock.now += 0.1
    core.join("c", SPECS)
    assert core.learners["c"].start_position == 3  # after fragment 1 (offset 2): c pushes fragment 2 first


def test_a_learner_joining_a_decoupled_run_keeps_its_own_schedule():
    core, _ = make_core(learners=2)
    s = core.join("a", SPECS)
    assert push(core, "a", s, 1, fragment=1).accepted
    core.join("b", SPECS)
    assert core.learners["b"].start_position is None  # the paper's learners are independent


@pytest.mark.parametrize("down", ["fp32", "int8"])
def test_a_join_reads_lent_values_which_later_rounds_leave_alone(down):
    core, _ = make_core(learners=1, grace=0.0, down_codec=down)
    s = core.join("a", SPECS)
    push(core, "a", s, 1)
    core.poll()  # with int8 down, P now differs from Θ: the published copy is what is lent
    lent = core.snapshot_for_join("a", copy=False)
    assert all(values is core.fragments[i].values for i, _, values in lent)  # no copy
    before = [values.clone() for _, _, values in lent]
    push(core, "a", s, 2)
    assert core.poll()
    assert all(torch.equal(values, b) for (_, _, values), b in zip(lent, before))  # the join still sends version 1
    fs = core.fragments[1]
    assert fs.version == 2 and not torch.equal(fs.values, before[1]) and not fs.loans
    push(core, "a", s, 3)
    values = fs.values
    core.poll()
    assert fs.values is values  # nothing lent any more: rounds change the values in place again


def test_values_a_join_gave_back_are_changed_in_place_by_the_next_round():
    core, _ = make_core(learners=1, grace=0.0, down_codec="int8")
    s = core.join("a", SPECS)
    lent = core.snapshot_for_join("a", copy=False)
    second = core.snapshot_for_join("a", copy=False)  # two joins streaming at once
    for (i, _, values), (_, _, again) in zip(lent, second):
        core.fragments[i].give_back(values)
    fs = core.fragments[1]
    values = fs.values
    push(core, "a", s, 1)
    core.poll()
    assert fs.published is not values  # the second join still reads version 0: the round changed a copy
    for i, _, values in second:
        core.fragments[i].give_back(values)  # gives back values no longer the fragment's: nothing counted
    assert fs.loans == 0
    lent = core.snapshot_for_join("a", copy=False)
    for i, _, values in lent:
        core.fragments[i].give_back(values)
    values = fs.values
    push(core, "a", s, 2)
    core.poll()
    assert fs.values is values  # given back before the round: no copy of the fragment


def test_a_learner_that_left_counts_in_the_share_of_progress_made_while_it_trained():
    # the last learner to finish a run must not add its final steps as a full outer step: those steps ran beside
    # the final steps of a learner that already left, whose own last push was merged as a half
    core, clock = make_core(learners=2, grace=0.0, grace_expect_steps=0.0, outer_momentum=0.0, outer_lr=1.0)
    sessions = {x: core.join(x, SPECS) for x in "ab"}
    for x in "ab":
        core.heartbeat(x, sessions[x], step_seconds=1.0)
        push(core, x, sessions[x], 1, value=0.0, steps=4, tokens=400)
        core.poll()
    clock.now += 4.0
    push(core, "b", sessions["b"], 2, value=0.0, steps=4, tokens=400)  # b's last progress, then it leaves
    core.poll()
    core.leave("b", sessions["b"])
    clock.now += 1.0  # a's last 4 steps began 3 s before b left
    before = core.fragments[1].outer_values().clone()
    push(core, "a", sessions["a"], 2, value=1.0, steps=4, tokens=400)
    core.poll()
    assert torch.allclose(core.fragments[1].outer_values(), before - 0.5, atol=1e-6)
    clock.now += 10.0  # from here a trains alone: its progress is the run's, a full step
    before = core.fragments[1].outer_values().clone()
    push(core, "a", sessions["a"], 3, value=1.0, steps=4, tokens=400)
    core.poll()
    assert torch.allclose(core.fragments[1].outer_values(), before - 1.0, atol=1e-6)
    core.join("b", SPECS)  # back: live again, and no longer counted as having left
    assert core.learners["b"].left_at is None


def test_a_push_of_a_session_replaced_by_a_rejoin_is_merged_but_not_answered():
    core, _ = make_core(learners=1, grace=0.0)
    old = core.join("a", SPECS)
    assert push(core, "a", old, 1, value=0.3).accepted  # under way when its process was killed
    new = core.join("a", SPECS)  # the restarted process, under the same id, holds the values of its join
    joined_at = dict(core.learners["a"].versions)
    assert core.poll() == []  # merged, but its answer would be a change from values the new session never held
    assert core.fragments[1].version == joined_at[1] + 1 and core.learners["a"].versions == joined_at
    held = {i: v for i, _, v in core.snapshot_for_join("a")}
    receiver = Receiver()
    receiver.reset([(i, core.fragments[i].version, held[i].clone()) for i in held], keep_overlap=False)
    assert push(core, "a", new, 1, value=0.3).accepted
    (pub,) = core.poll()
    assert receiver.accept(pub)  # the new session's answers start from what it holds


def test_answers_computed_before_a_rejoin_are_not_delivered_to_the_new_session():
    from diloco.syncer.observation.metrics import SyncerMetrics
    from diloco.syncer.serving.service import SyncerService

    core, _ = make_core(learners=1, grace=0.0)
    service = SyncerService(core, SyncerMetrics())
    old = core.join("a", SPECS)
    push(core, "a", old, 1, value=0.3)
    answers = core.poll()  # the round closed just before the re-join; its answers are delivered just after
    assert len(answers) == 1 and answers[0].session == core.learners["a"].session_hash
    core.join("a", SPECS)
    service.deliver(answers)
    assert service._queue("a").qsize() == 0


def test_answers_to_a_learner_that_left_are_not_queued():
    from diloco.syncer.observation.metrics import SyncerMetrics
    from diloco.syncer.serving.service import SyncerService

    core, _ = make_core(learners=2, grace=0.0, quorum=1)
    service = SyncerService(core, SyncerMetrics())
    a, b = core.join("a", SPECS), core.join("b", SPECS)
    push(core, "a", a, 1, value=0.3)
    push(core, "b", b, 1, value=0.2)
    core.leave("a", a)  # its last push is still in an open round, as when a learner finishes
    answers = core.poll()
    assert {pub.learner for pub in answers} == {"a", "b"}
    service.deliver(answers)
    assert service._queue("a").qsize() == 0 and service._queue("b").qsize() == 1


def test_the_budget_counts_what_was_trained_between_pushes_when_applies_restart_a_learners_counters():
    # published to every live learner, a learner applies each fragment between its own pushes of it, and its
    # counters run from that apply: its second pushes carry 100 tokens of the 600 it trained since its first
    core, _ = make_core(publish_to="live", down_codec="fp32", max_counter_ratio=0.0)
    core.token_budget = 10_000
    a = core.join("a", SPECS)
    core.heartbeat("a", a, tokens_trained=600)
    for fragment in range(3):  # every token trains every fragment
        assert push(core, "a", a, 1 + fragment, fragment=fragment, tokens=600).accepted
    core.heartbeat("a", a, tokens_trained=1200)
    for fragment in range(3):
        assert push(core, "a", a, 4 + fragment, fragment=fragment, tokens=100).accepted
    assert core.budget_tokens() == 1200  # was 1000: the counters' 700 and two cycles of 25 tokens a step


def test_a_claim_stands_for_a_push_only_as_far_as_the_time_it_had_allows():
    core, clock = make_core(max_counter_ratio=4.0)
    sessions = {lid: core.join(lid, SPECS) for lid in ("a", "b")}
    for lid in ("a", "b"):  # both push every fragment, 400 tokens in 4 steps, one second apart
        for fragment in range(3):
            assert push(core, lid, sessions[lid], 1 + fragment, fragment=fragment).accepted
    clock.now += 1.0
    core.heartbeat("a", sessions["a"], tokens_trained=10**9)  # a claims a billion tokens trained in that second
    core.heartbeat("b", sessions["b"], tokens_trained=400)
    for lid in ("b", "a"):  # b's second pushes give the others' typical speed: 400 tokens a second
        for fragment in range(3):
            assert push(core, lid, sessions[lid], 4 + fragment, fragment=fragment).accepted
    # a's second pushes vouch for at most 4× b's 400 tokens a second, however much it claims
    assert core.learners["a"].tokens_backed == pytest.approx(4 * 400)
    assert core.budget_tokens() == pytest.approx(4 * 400 + 2 * 6 * 100 + 400)  # a's, with two cycles; b's


def test_pushes_of_one_fragment_vouch_for_all_a_learner_trained_and_the_vouching_survives_a_restart(tmp_path):
    # a learner whose other fragments wait on their last results pushes one fragment only: its claims still count
    from diloco.syncer.at_rest.store import StateStore

    core, clock = make_core(publish_to="live", down_codec="fp32", max_counter_ratio=0.0)
    core.token_budget, core.store = 100_000, StateStore(tmp_path)
    a = core.join("a", SPECS)
    for seq in range(1, 6):
        clock.now += 1.0
        core.heartbeat("a", a, tokens_trained=1000 * seq)
        assert push(core, "a", a, seq, fragment=1, tokens=100).accepted
    assert core.budget_tokens() == 5000  # the counters alone: 500 tokens over three fragments
    core.poll(force=True)
    core.persist(range(len(core.fragments)))
    resumed, _ = make_core(publish_to="live", down_codec="fp32", max_counter_ratio=0.0)
    resumed.store, resumed.token_budget = StateStore(tmp_path), 100_000
    assert resumed.restore() and resumed.budget_tokens() == 5000
