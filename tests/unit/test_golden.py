"""Golden trajectories: the Learner + syncer machinery reproduces plain training and synchronous DiLoCo."""

import copy
import threading

import pytest
import torch
from torch import nn

from diloco.algorithm import codec
from diloco.config import for_mode
from diloco.algorithm.fragments import TensorSpec
from diloco.learner.learner import Learner
from diloco.inprocess import LocalSyncer, LocalTransport
from diloco.syncer.core import SyncerCore


class FixedGradient(nn.Module):
    """A 1×1 model whose loss is w·g, so every inner step moves w by −lr·g: values computable by hand."""

    def __init__(self, w=1.0):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([w]))

    def loss(self, g):
        return (self.w * g).sum()


def train_steps(model, opt, learner, grads, tokens=10):
    for g in grads:
        opt.zero_grad()
        model.loss(g).backward()
        opt.step()
        if learner is not None:
            learner.step(tokens)


TOY = dict(norm_ceiling=0.0, max_round_ratio=0.0, clip_norm_ratio=0.0, refuse_replays=False)
"""A one-scalar model moved by several times its value per step: far over the outlier ceiling and the bound on a
round's step meant for real models, and beside the arithmetic these tests check; fixed gradients repeat a push's
Δ byte for byte, which the refusal of replays is for."""


def test_one_learner_h1_unit_lr_no_momentum_is_plain_training_fixed_gradient():
    cfg = for_mode("decoupled", 1, fragments=1, sync_every=1, overlap=0, outer_lr=1.0, outer_momentum=0.0, codec="fp32",
                   down_codec="fp32", **TOY)
    local = LocalSyncer(SyncerCore(cfg))
    model = FixedGradient()
    learner = Learner(model, LocalTransport(local), "solo")
    opt = torch.optim.SGD(model.parameters(), lr=0.25)
    history = []
    for g in [1.0, 2.0, -4.0, 0.5]:
        train_steps(model, opt, learner, [g])
        history.append(model.w.item())
    assert history == [0.75, 0.25, 1.25, 1.125]
    assert local.core.fragments[0].outer_values().item() == 1.125 and local.core.fragments[0].version == 4


def tiny_net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(16, 8), nn.Flatten(), nn.Linear(8 * 4, 16), nn.Tanh(), nn.Linear(16, 3))


def batches(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 16, (5, 4), generator=g), torch.randint(0, 3, (5,), generator=g)) for _ in range(n)]


def adam_step(model, opt, x, y):
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def test_one_learner_h1_reproduces_plain_adamw_training():
    cfg = for_mode("decoupled", 1, fragments=1, sync_every=1, overlap=0, outer_lr=1.0, outer_momentum=0.0, codec="fp32", down_codec="fp32")
    plain, wrapped = tiny_net(), tiny_net()
    learner = Learner(wrapped, LocalTransport(LocalSyncer(SyncerCore(cfg))), "solo")
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    opt_wrapped = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    for x, y in batches(30, 1):
        adam_step(plain, opt_plain, x, y)
        adam_step(wrapped, opt_wrapped, x, y)
        learner.step(20)
    for a, b in zip(plain.parameters(), wrapped.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def run_learners_in_threads(cfg, models, optimizers, schedules, tokens=10):
    local = LocalSyncer(SyncerCore(cfg))
    learners = [Learner(m, LocalTransport(local), f"l{i}") for i, m in enumerate(models)]
    errors = []

    def work(i):
        try:
            for item in schedules[i]:
                if isinstance(models[i], FixedGradient):
                    train_steps(models[i], optimizers[i], learners[i], [item], tokens)
                else:
                    adam_step(models[i], optimizers[i], *item)
                    learners[i].step(tokens)
        except Exception as e:  # surfaced below: a thread's failure must fail the test
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(models))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)
    return local


def test_k_equals_m_p1_reproduces_synchronous_diloco_by_hand():
    # Θ0 = 1, learners with fixed gradients 1 and 3, inner SGD lr 0.25, H = 2, η = 0.5, μ = 0.5, mean merge.
    # Each round Δ_m = 2·0.25·g_m, mean Δ = 1; v = 1, 1.5, 1.75; Θ = 0.25, −0.625, −1.5625 (by hand).
    cfg = for_mode("diloco", 2, sync_every=2, outer_lr=0.5, outer_momentum=0.5, merge="mean", **TOY)
    models = [FixedGradient(), FixedGradient()]
    opts = [torch.optim.SGD(m.parameters(), lr=0.25) for m in models]
    local = run_learners_in_threads(cfg, models, opts, [[1.0] * 6, [3.0] * 6])
    assert [m.w.item() for m in models] == [-1.5625, -1.5625]
    assert local.core.fragments[0].outer_values().item() == -1.5625 and local.core.fragments[0].version == 3


def reference_diloco(models, data, rounds, H, lr, mu, inner_lr):
    """Synchronous DiLoCo written plainly, with torch's own Nesterov SGD as the outer optimizer."""
    global_model = copy.deepcopy(models[0])
    outer = torch.optim.SGD(global_model.parameters(), lr=lr, momentum=mu, nesterov=True)
    inner = [torch.optim.AdamW(m.parameters(), lr=inner_lr) for m in models]
    for r in range(rounds):
        for m, opt, d in zip(models, inner, data):
            m.load_state_dict(global_model.state_dict())
            for x, y in d[r * H : (r + 1) * H]:
                adam_step(m, opt, x, y)
        outer.zero_grad()
        for gp, *ps in zip(global_model.parameters(), *[m.parameters() for m in models]):
            gp.grad = sum(gp.detach() - p.detach() for p in ps) / len(ps)
        outer.step()
    return global_model


def test_k_equals_m_p1_matches_reference_diloco_on_a_real_model():
    H, rounds, M = 3, 4, 3
    data = [batches(H * rounds, 10 + i) for i in range(M)]
    expected = reference_diloco([tiny_net() for _ in range(M)], data, rounds, H, 0.7, 0.9, 1e-2)
    cfg = for_mode("diloco", M, sync_every=H, merge="mean")
    models = [tiny_net() for _ in range(M)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    local = run_learners_in_threads(cfg, models, opts, data)
    got = local.core.params()
    for name, p in expected.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=0, atol=1e-5)
    assert all(fs.version == rounds for fs in local.core.fragments)


def overlap_trajectory(keep: bool) -> list[float]:
    cfg = for_mode("decoupled", 1, fragments=1, sync_every=2, overlap=1, outer_lr=1.0, outer_momentum=0.0,
                   codec="fp32", down_codec="fp32", keep_overlap=keep, **TOY)
    model = FixedGradient()
    learner = Learner(model, LocalTransport(LocalSyncer(SyncerCore(cfg))), "solo")
    opt = torch.optim.SGD(model.parameters(), lr=0.25)
    out = []
    for _ in range(6):
        train_steps(model, opt, learner, [1.0])
        out.append(model.w.item())
    return out


def test_keeping_the_overlap_reproduces_plain_training_and_overwrite_loses_the_overlapped_step():
    # push after steps 2, 4, 6 (Δ = base − w); the merged value is applied one step later (τ = 1)
    assert overlap_trajectory(keep=True) == [0.75, 0.5, 0.25, 0.0, -0.25, -0.5]
    # overwrite: at step 3 w is reset to Θ = 0.5, so every third step's progress is discarded
    assert overlap_trajectory(keep=False) == [0.75, 0.5, 0.5, 0.25, 0.25, 0.0]


class ScriptedTransport:
    """A transport whose answers the test delivers by hand."""

    def __init__(self, cfg):
        from diloco.learner.transport import JoinInfo

        self.cfg, self.jobs, self.inbox, self.lead = cfg, [], [], None
        self.JoinInfo = JoinInfo
        self.stop_requested, self.wire_bytes = False, 0

    def join(self, learner_id, specs, initial):
        return self.JoinInfo(self.cfg, "s", [(i, 0, v) for i, v in enumerate(initial(self.cfg.fragments))])

    def push(self, job):
        self.jobs.append(job)

    def arrivals(self, timeout=None):
        out, self.inbox = self.inbox, []
        return out

    def report(self, **progress):
        pass

    def take_phase_lead(self):
        lead, self.lead = self.lead, None
        return lead


def test_an_answer_to_an_earlier_push_is_never_applied():
    from diloco.learner.transport import Arrival

    cfg = for_mode("decoupled", 1, fragments=1, sync_every=2, overlap=0)
    model = FixedGradient()
    transport = ScriptedTransport(cfg)
    learner = Learner(model, transport, "a")
    opt = torch.optim.SGD(model.parameters(), lr=0.25)
    train_steps(model, opt, learner, [1.0, 1.0])  # push seq 1 after step 2
    assert [j.seq for j in transport.jobs] == [1]
    transport.inbox.append(Arrival(0, 7, torch.tensor([9.0]), seq=99))  # answers a push we never made: ignored
    train_steps(model, opt, learner, [1.0])
    assert learner.applied == 0 and model.w.item() == 0.25
    transport.inbox.append(Arrival(0, 1, torch.tensor([0.5]), seq=1))  # the answer to seq 1: applied
    train_steps(model, opt, learner, [1.0])
    assert learner.applied == 1


def test_a_learner_out_of_phase_shifts_its_push_schedule_by_its_lead():
    cfg = for_mode("decoupled", 2, fragments=4, sync_every=4, overlap=0, align_pushes=True)
    model = nn.ParameterDict({name: nn.Parameter(torch.zeros(1)) for name in "abcd"})
    transport = ScriptedTransport(cfg)
    learner = Learner(model, transport, "a")
    pushed = []

    def step(lead=None):
        transport.lead = lead
        before = len(transport.jobs)
        for slot in learner.slots:
            slot.pushed_at = None  # as if every result had come back
        learner.step(10)
        pushed.append([j.fragment for j in transport.jobs[before:]])

    # offsets 0, 1, 2, 3: fragment p is due after steps with t ≡ p (mod 4)
    step(), step(), step(-1.2)  # a step behind: step 3 pushes the next step's fragment 0 as well as its own 3
    assert pushed == [[1], [2], [3, 0]] and learner.realigned == 1
    step(-1.2)  # the syncer needs ALIGN_EVERY steps to see a correction: ignored until then
    assert pushed[-1] == [1] and learner.realigned == 1
    step(), step(), step(0.5)  # less than a step off: no correction
    assert pushed[-3:] == [[2], [3], [0]]
    step(2.2)  # two steps ahead: nothing for two steps; fragment 1 goes two steps later
    step(), step()
    assert pushed[-3:] == [[], [], [1]] and learner.realigned == 2
    for _ in range(3):
        step()
    step(-2.6)  # three steps behind: the fragments of the next three positions go now as well
    assert pushed[-4:] == [[2], [3], [0], [1, 2, 3, 0]] and learner.realigned == 3
    step()
    assert pushed[-1] == [1]


def test_pushes_keep_the_plain_schedule_when_alignment_is_off():
    cfg = for_mode("decoupled", 2, fragments=1, sync_every=2, overlap=0, align_pushes=False)
    model = FixedGradient()
    transport = ScriptedTransport(cfg)
    learner = Learner(model, transport, "a")
    opt = torch.optim.SGD(model.parameters(), lr=0.25)
    for _ in range(2):
        transport.lead = -3.0
        train_steps(model, opt, learner, [1.0])
    assert [j.seq for j in transport.jobs] == [1] and learner.realigned == 0


def test_the_in_process_transport_honours_error_feedback():
    cfg = for_mode("decoupled", 1, fragments=1, sync_every=1, overlap=0, codec="int4", error_feedback=True)
    transport = LocalTransport(LocalSyncer(SyncerCore(cfg)))
    model = FixedGradient()
    learner = Learner(model, transport, "a")
    opt = torch.optim.SGD(model.parameters(), lr=0.25)
    train_steps(model, opt, learner, [1.0])
    assert 0 in transport._feedback._residual  # the quantisation error is carried into the next push


@pytest.mark.parametrize("publish_to", ["live", "contributors"])
def test_paper_preset_takes_a_full_outer_step_for_each_k1_partial_round(publish_to):
    # Θ0 = 1, K = 1, P = 1, H = 2, τ = 0, inner SGD lr 0.25, DiLoCo's η = 0.7, μ = 0.9 (the paper preset).
    # A (g = 1) pushes Δ_A = 0.5 alone: v = 0.5, Θ1 = 1 − 0.7·(0.5 + 0.9·0.5) = 0.335.
    # live (the paper): B (g = 3) gets Θ1 unasked and applies it after its first step (overwriting 0.25), then
    #   pushes Δ_B = 0.335 − (0.335 − 0.75) = 0.75 on version 1: v = 0.45 + 0.75 = 1.2, Θ2 = 0.335 − 0.7·1.83 = −0.946;
    #   A, with no push in flight, gets Θ2 unasked and applies it at its next step.
    # contributors: B trains on from 1 and pushes Δ_B = 1.5 on version 0: v = 1.95, Θ2 = 0.335 − 0.7·3.255 = −1.9435.
    cfg = for_mode("decoupled", 2, preset="paper", fragments=1, sync_every=2, overlap=0, codec="fp32",
                   publish_to=publish_to)
    assert (cfg.outer_lr, cfg.outer_momentum, cfg.down_codec, cfg.scale_partial_rounds) == (0.7, 0.9, "fp32", False)
    local = LocalSyncer(SyncerCore(cfg))
    models = [FixedGradient(), FixedGradient()]
    learners = [Learner(m, LocalTransport(local), name) for m, name in zip(models, "AB")]
    opts = [torch.optim.SGD(m.parameters(), lr=0.25) for m in models]
    train_steps(models[0], opts[0], learners[0], [1.0, 1.0])
    assert models[0].w.item() == pytest.approx(0.335, abs=1e-6)
    train_steps(models[1], opts[1], learners[1], [3.0, 3.0])
    theta2, momentum = (-0.946, 1.2) if publish_to == "live" else (-1.9435, 1.95)
    assert models[1].w.item() == pytest.approx(theta2, abs=1e-6)
    fs = local.core.fragments[0]
    assert fs.version == 2 and fs.outer_values().item() == pytest.approx(theta2, abs=1e-6)
    assert fs.momentum.item() == pytest.approx(momentum, abs=1e-6)
    train_steps(models[0], opts[0], learners[0], [1.0])  # A's third step: no push due
    expected_a = theta2 if publish_to == "live" else 0.335 - 0.25
    assert models[0].w.item() == pytest.approx(expected_a, abs=1e-6)


@pytest.mark.parametrize("preset, weight_b", [("paper", 3.0), ("default", 1.0)])
def test_a_3h_step_contribution_weighs_tokens_squared_over_steps_in_the_paper_preset(preset, weight_b):
    # One round, mean merge, fp32: A brings H = 2 steps of 10 tokens each and Δ_A = 1; B, back from a
    # disconnection, 3H = 6 steps and Δ_B = 2. Paper: w = tokens²/steps, 20²/2 = 200 and 60²/6 = 600;
    # default: B counts as H steps and 60·H/6 = 20 tokens, so w_B = w_A.
    cfg = for_mode("decoupled", 2, preset=preset, fragments=1, sync_every=2, overlap=1, codec="fp32",
                   down_codec="fp32", merge="mean", quorum=2, outer_lr=1.0, outer_momentum=0.0,
                   scale_partial_rounds=False, delayed_momentum=False, **TOY)
    core = SyncerCore(cfg)
    spec = [TensorSpec("w", (1,), "float32")]
    core.initialize(spec, [torch.zeros(1)])
    sa, sb = core.join("A", spec), core.join("B", spec)
    assert core.push("A", sa, 1, 0, 0, 2, 20, codec.encode(torch.tensor([1.0]), "fp32")).accepted
    assert core.push("B", sb, 1, 0, 0, 6, 60, codec.encode(torch.tensor([2.0]), "fp32")).accepted
    core.poll(force=True)
    w_a = 20**2 / 2
    w_b = weight_b * w_a
    expected = -(w_a * 1.0 + w_b * 2.0) / (w_a + w_b)  # Θ = 0 − η·Δ with η = 1, μ = 0
    assert core.fragments[0].outer_values().item() == pytest.approx(expected, abs=1e-6)
