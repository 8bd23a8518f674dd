"""Durable syncer state: consistent after a crash at any write step; a restarted core resumes exactly."""

import pytest
import torch

from diloco.algorithm.fragments import TensorSpec, plan_fragments
from diloco import atomic
from diloco.syncer.at_rest.state_key import StateKey
from diloco.syncer.at_rest.store import StateStore
from fakes import push_value, stored_core

SPECS = [TensorSpec("emb", (4, 2), "float32", True), TensorSpec("w1", (3, 2), "float32"), TensorSpec("w2", (5,), "float32")]


def state(version):
    return {"ledger": {"v": version}}, {1: (version, {"theta": torch.full((3,), float(version))})}


def test_round_trip(tmp_path):
    s = StateStore(tmp_path)
    assert not s.exists and s.load() is None
    s.save({"v": 1}, {0: (1, {"theta": torch.ones(2)}), 1: (1, {"theta": torch.zeros(3)})})
    s.save({"v": 2}, {1: (2, {"theta": torch.full((3,), 2.0)})})
    loaded = StateStore(tmp_path).load()
    assert loaded.ledger == {"v": 2}
    assert torch.equal(loaded.fragments[0]["theta"], torch.ones(2)) and torch.equal(loaded.fragments[1]["theta"], torch.full((3,), 2.0))
    # the previous generation (manifest.prev.json and the files it names) is kept until a newer one is written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fragment-0-v1.safetensors", "fragment-1-v1.safetensors", "fragment-1-v2.safetensors", "ledger-1.json", "ledger-2.json", "manifest.json", "manifest.prev.json"]
    s.save({"v": 3}, {1: (3, {"theta": torch.full((3,), 3.0)})})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fragment-0-v1.safetensors", "fragment-1-v2.safetensors", "fragment-1-v3.safetensors", "ledger-2.json", "ledger-3.json", "manifest.json", "manifest.prev.json"]


class Crash(Exception):
    pass


@pytest.mark.parametrize("crash_at", range(1, 12))  # every step of a save, the previous manifest included
def test_a_crash_at_any_write_step_leaves_a_consistent_loadable_state(tmp_path, monkeypatch, crash_at):
    s = StateStore(tmp_path)
    s.save({"v": 1}, {1: (1, {"theta": torch.full((3,), 1.0)})})
    calls = {"n": 0}
    real_replace, real_fsync, real_unlink = atomic.os.replace, atomic.os.fsync, type(tmp_path).unlink

    def step(real):
        def wrapped(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == crash_at:
                raise Crash()
            return real(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(atomic.os, "replace", step(real_replace))
    monkeypatch.setattr(atomic.os, "fsync", step(real_fsync))
    monkeypatch.setattr(type(tmp_path), "unlink", step(real_unlink))
    try:
        s.save({"v": 2}, {1: (2, {"theta": torch.full((3,), 2.0)})})
    except Crash:
        pass
    monkeypatch.undo()
    loaded = StateStore(tmp_path).load()
    v = loaded.ledger["v"]
    assert v in (1, 2)
    assert torch.equal(loaded.fragments[1]["theta"], torch.full((3,), float(v)))  # ledger and tensors agree


def test_a_crash_before_the_first_record_of_a_generation_resumes(tmp_path, monkeypatch):
    """A manifest is never on disk without a record of a generation at most its own (a missing one is refused)."""
    def crash(self, generation):
        raise Crash()

    s = StateStore(tmp_path)
    real = StateKey.remember
    monkeypatch.setattr(StateKey, "remember", lambda self, g: real(self, g) if g == 0 else crash(self, g))
    with pytest.raises(Crash):
        s.save({"v": 1}, {1: (1, {"theta": torch.ones(3)})})  # the manifest is written, its record is not
    monkeypatch.undo()
    assert StateStore(tmp_path).load().ledger == {"v": 1}


def test_restarted_core_resumes_exactly_and_merges_each_push_at_most_once(tmp_path):
    core = stored_core(StateStore(tmp_path), outer_momentum=0.9)  # momentum in use: it must come back exactly
    core.initialize(SPECS, [torch.arange(f.numel, dtype=torch.float32) for f in plan_fragments(SPECS, 3)])
    sa, sb = core.join("a", SPECS), core.join("b", SPECS)
    for seq in (1, 2, 3):
        push_value(core, "a", sa, seq)
        push_value(core, "b", sb, seq, value=0.25)
        core.poll()
    push_value(core, "a", sa, 4)  # admitted but not merged when the syncer dies: lost with it
    restarted = stored_core(StateStore(tmp_path), outer_momentum=0.9)
    assert restarted.restore()
    for a, b in zip(core.fragments, restarted.fragments):
        assert a.version == b.version and torch.equal(a.outer_values(), b.outer_values()) and torch.equal(a.momentum, b.momentum)
    assert restarted.rounds == core.rounds == 3 and restarted.fragments[1].pending == {}
    assert list(restarted.round_log) == list(core.round_log) and len(core.round_log) == 3  # the uptime history
    assert restarted.learners["a"].tokens_merged == core.learners["a"].tokens_merged
    again = push_value(restarted, "a", sa, 3)  # merged before the crash: ignored, current values sent instead
    assert again.accepted and again.duplicate and again.resync
    lost = push_value(restarted, "a", sa, 4)  # pending at the crash: merged now
    assert lost.accepted and not lost.duplicate
    assert len(restarted.poll()) == 1 and restarted.fragments[1].version == 4


def test_history_beyond_the_restored_state_is_dropped(tmp_path):
    core = stored_core(StateStore(tmp_path))
    core.initialize(SPECS, [torch.arange(f.numel, dtype=torch.float32) for f in plan_fragments(SPECS, 3)])
    sa = core.join("a", SPECS)
    push_value(core, "a", sa, 1)
    core.poll()
    core.store.append_round((9.9, 1, 2, 1))  # a crash right after the history line, before the state was written
    restarted = stored_core(StateStore(tmp_path))
    assert restarted.restore()
    assert [e[2] for e in restarted.round_log] == [1] and StateStore(tmp_path).rounds(10) == [tuple(restarted.round_log[0])]


def test_without_outer_momentum_only_theta_is_written_and_the_run_resumes_alike(tmp_path):
    core = stored_core(StateStore(tmp_path))  # decoupled: μ = 0
    core.initialize(SPECS, [torch.arange(f.numel, dtype=torch.float32) for f in plan_fragments(SPECS, 3)])
    sa = core.join("a", SPECS)
    for seq in (1, 2):
        push_value(core, "a", sa, seq)
        core.poll()
    stored = StateStore(tmp_path).load().fragments[1]
    assert stored["momentum"].numel() == 0 and stored["pending_delta"].numel() == 0  # a third of the bytes
    restarted = stored_core(StateStore(tmp_path))
    assert restarted.restore()
    for c in (core, restarted):  # the same next round on both: μ = 0 makes the momentum irrelevant
        push_value(c, "a", sa, 3, value=0.75)
        c.poll()
    assert torch.equal(core.fragments[1].outer_values(), restarted.fragments[1].outer_values())


def test_a_restarted_core_lays_out_a_split_model_as_it_was_stored(tmp_path):
    specs = [TensorSpec("emb", (40, 2), "float32", True), TensorSpec("w", (30, 2), "float32")]
    core = stored_core(StateStore(tmp_path), split_tensors=True)
    layout = plan_fragments(specs, 3, split=True)
    assert any(not s.whole for f in layout for s in f.specs)
    core.initialize(specs, [torch.arange(f.numel, dtype=torch.float32) for f in layout])
    sa = core.join("a", specs)
    push_value(core, "a", sa, 1)
    core.poll()
    restarted = stored_core(StateStore(tmp_path), split_tensors=True)
    assert restarted.restore()
    assert [fs.fragment for fs in restarted.fragments] == layout
    assert all(torch.equal(a.outer_values(), b.outer_values()) for a, b in zip(core.fragments, restarted.fragments))
    assert all(torch.equal(v, core.params()[k]) for k, v in restarted.params().items())
