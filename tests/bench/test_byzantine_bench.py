"""benchmarks/hostile/byzantine.py: each attack sends what its docstring says."""


import pytest
import torch

from benchmarks.hostile.byzantine import ATTACKS, attacked, stale


def send(attack, delta, pushes_before=0, directions=None, fragment=0):
    return attacked(attack, delta, pushes_before, torch.Generator().manual_seed(0),
                    {} if directions is None else directions, fragment)


@pytest.fixture
def delta():
    return torch.randn(4096, generator=torch.Generator().manual_seed(1))


def cosine(a, b):
    return (a @ b / (a.norm() * b.norm())).item()


def test_sign_flips_noise_and_free_riding(delta):
    assert torch.equal(send("sign-flip", delta), -delta)
    noise = send("noise", delta)
    assert noise.norm().item() == pytest.approx(45 * delta.norm().item(), rel=1e-5) and abs(cosine(noise, delta)) < 0.1
    assert not send("free-rider", delta).any()
    for honest_delta in ("replay", "stale", "inflate-tokens", "tiny-weight", "heartbeat-tokens"):  # they change the job
        assert send(honest_delta, delta) is None


def test_flip_some_flips_two_of_every_five_pushes(delta):
    sent = [send("flip-some", delta, pushes_before=i) for i in range(10)]
    flipped = [i for i, d in enumerate(sent) if d is not None and torch.equal(d, -delta)]
    assert flipped == [1, 3, 6, 8] and all(d is None for i, d in enumerate(sent) if i not in flipped)


def test_aligned_noise_keeps_the_cosine_the_direction_test_admits(delta):
    sent = send("noise-aligned", delta)
    assert cosine(sent, delta) == pytest.approx(0.6, abs=1e-4)
    assert sent.norm().item() == pytest.approx(45 * delta.norm().item(), rel=1e-4)


def test_drift_adds_half_the_norm_along_one_direction_per_fragment(delta):
    directions = {}
    first, second = send("drift", delta, directions=directions), send("drift", delta, directions=directions)
    assert torch.allclose(first, second)  # the same direction every push
    assert (first - delta).norm().item() == pytest.approx(0.5 * delta.norm().item(), rel=1e-5)
    assert set(ATTACKS) >= {"flip-some", "noise-aligned"}


def test_alie_moves_each_coordinate_one_deviation_against_the_mean(delta):
    assert send("alie", delta) is None  # one push: no spread to hide in yet
    g = torch.Generator().manual_seed(2)
    recent = [delta + 0.3 * torch.randn(4096, generator=g) for _ in range(4)] + [delta]
    sent = attacked("alie", delta, 4, torch.Generator().manual_seed(0), {}, 0, recent)
    spread, mean = torch.stack(recent).std(0), torch.stack(recent).mean(0)
    assert torch.allclose(sent - delta, -spread * torch.sign(mean))
    assert cosine(sent, delta) > 0.5  # in the honest spread, not a flip


def test_ipm_sends_the_negated_recent_mean_inside_the_clip(delta):
    g = torch.Generator().manual_seed(2)
    recent = [delta + 0.3 * torch.randn(4096, generator=g) for _ in range(4)] + [delta]
    sent = attacked("ipm", delta, 4, torch.Generator().manual_seed(0), {}, 0, recent)
    assert cosine(sent, torch.stack(recent).mean(0)) == pytest.approx(-1.0, abs=1e-5)
    assert sent.norm().item() == pytest.approx(1.9 * delta.norm().item(), rel=1e-5)


def test_a_stale_replay_has_new_bytes_and_the_old_step(delta):
    from diloco.algorithm import codec

    old = codec.encode(1e-3 * delta, "int4")
    sent = stale(old, torch.Generator().manual_seed(0))
    assert sent.codec == "int4" and sent.data != old.data  # the byte-for-byte refusal does not see it
    assert cosine(codec.decode(sent), codec.decode(old)) > 0.999
