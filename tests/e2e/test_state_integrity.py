"""Hostile and broken durable state: every damaged, swapped, edited or missing file is refused with a message
naming it; the previous consistent generation is a way out; a full or read-only state directory is logged, shown
in /status and retried, and the final model still lands somewhere."""

import errno
import json
import logging
import re
import tempfile
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from diloco import atomic

from diloco.algorithm import codec
from diloco.config import for_mode
from diloco.algorithm.fragments import plan_fragments
from diloco.syncer.serving.server import ServerOptions, SyncerThread
from diloco.syncer.at_rest.store import MANIFEST, PREVIOUS, StateError, StateStore, key_path
from fakes import push_value
from state_files import SPECS, make_core, manifest, refused, rehash, run


def test_a_flipped_byte_is_refused_naming_the_file_and_the_way_out(tmp_path):
    core, _ = run(tmp_path)
    name = manifest(tmp_path)["files"]["fragment-1"]
    data = bytearray((tmp_path / name).read_bytes())
    data[-3] ^= 0x01
    (tmp_path / name).write_bytes(bytes(data))
    text = refused(tmp_path)
    assert f"{tmp_path / name} is damaged (hash mismatch" in text
    assert f"--state-recover to resume from the previous consistent state (generation {manifest(tmp_path)['generation'] - 1})" in text


def test_nan_momentum_is_refused_even_with_a_matching_hash(tmp_path):
    run(tmp_path, outer_momentum=0.9)  # momentum is written only where it can move Θ
    name = manifest(tmp_path)["files"]["fragment-1"]
    tensors = load_file(str(tmp_path / name))
    tensors["momentum"][2] = float("nan")
    save_file(tensors, str(tmp_path / name))
    assert re.search(rf"{re.escape(str(tmp_path / name))} is damaged \((size|hash) mismatch", refused(tmp_path))
    rehash(tmp_path, name)
    assert f"{tmp_path / name} is damaged (tensor 'momentum' contains NaN or Inf)" in refused(tmp_path)


def test_a_fragment_file_swapped_for_another_is_refused(tmp_path):
    run(tmp_path)
    files = manifest(tmp_path)["files"]
    (tmp_path / files["fragment-1"]).write_bytes((tmp_path / files["fragment-0"]).read_bytes())
    assert f"{tmp_path / files['fragment-1']} is damaged (size mismatch" in refused(tmp_path)
    rehash(tmp_path, files["fragment-1"])
    text = refused(tmp_path)
    assert f"{tmp_path / files['fragment-1']} is damaged (tensor 'theta' has shape (8,), fragment 1" in text


def test_a_version_edited_in_the_ledger_is_refused(tmp_path):
    core, _ = run(tmp_path)
    files = manifest(tmp_path)["files"]
    ledger = json.loads((tmp_path / files["ledger"]).read_text())
    ledger["versions"][1] += 5
    (tmp_path / files["ledger"]).write_text(json.dumps(ledger))
    assert f"{tmp_path / files['ledger']} is damaged (hash mismatch" in refused(tmp_path)
    rehash(tmp_path, files["ledger"])
    text = refused(tmp_path)
    assert f"says fragment 1 is at version {core.fragments[1].version + 5} but its file is {files['fragment-1']}" in text


def test_a_deleted_manifest_is_refused_not_started_empty(tmp_path):
    run(tmp_path)
    (tmp_path / MANIFEST).unlink()
    assert "manifest.json is damaged (missing, though manifest.prev.json is there)" in refused(tmp_path)
    (tmp_path / PREVIOUS).unlink()
    text = refused(tmp_path)
    assert text.startswith(f"state directory {tmp_path} has fragment files but no manifest")
    assert make_core(tmp_path / "fresh").restore() is False  # an empty directory is a new run


def test_a_manifest_naming_a_file_outside_the_folder_is_refused_and_the_file_left_alone(tmp_path, monkeypatch):
    state = tmp_path / "state"
    run(state)
    outside = tmp_path / "outside.safetensors"
    save_file({"theta": torch.zeros(6), "momentum": torch.zeros(6), "pending_delta": torch.zeros(6)}, str(outside))
    before = outside.read_bytes()
    read = []
    real = type(outside).read_bytes
    monkeypatch.setattr(type(outside), "read_bytes", lambda self: read.append(self) or real(self))
    for evil in ("../outside.safetensors", str(outside)):
        m = manifest(state)
        m["files"]["fragment-1"] = evil
        (state / MANIFEST).write_text(json.dumps(m))
        text = refused(state)
        assert "manifest.json is damaged" in text and "not a plain file name inside the state directory" in text
    assert all(p.resolve().parent == state.resolve() for p in read if p != key_path(state))  # the key: beside it
    # a save on such a directory (no load first) deletes only its own files, never what the manifest names
    store = StateStore(state)
    store.save({"v": 1}, {1: (99, {"theta": torch.zeros(6)})})
    assert outside.read_bytes() == before


def test_recovery_from_the_previous_generation(tmp_path):
    core, session = run(tmp_path)
    newest = manifest(tmp_path)
    previous = manifest(tmp_path, PREVIOUS)
    assert previous["generation"] == newest["generation"] - 1
    (tmp_path / newest["files"]["fragment-1"]).write_bytes(b"garbage")
    assert "--state-recover" in refused(tmp_path)
    recovered = make_core(tmp_path, recover=True)
    assert recovered.restore()
    assert recovered.fragments[1].version == core.fragments[1].version - 1  # the round before the damaged one
    # the learner's push of the lost round is merged again; the directory is consistent again afterwards
    again = push_value(recovered, "a", session, 4)
    assert again.accepted and len(recovered.poll()) == 1
    restarted = make_core(tmp_path)
    assert restarted.restore() and restarted.fragments[1].version == recovered.fragments[1].version
    assert torch.equal(restarted.fragments[1].outer_values(), recovered.fragments[1].outer_values())
    # both generations damaged: nothing to offer but a new run
    for m in (manifest(tmp_path), manifest(tmp_path, PREVIOUS)):
        (tmp_path / m["files"]["ledger"]).write_text("{")
    with pytest.raises(StateError, match="the previous state is damaged too"):
        make_core(tmp_path, recover=True).restore()


def test_an_edited_configuration_is_adopted_with_the_differing_fields_named(tmp_path, caplog):
    run(tmp_path)
    core = make_core(tmp_path, outer_lr=0.123)
    with caplog.at_level(logging.WARNING, logger="diloco.syncer"):
        assert core.restore()
    assert core.cfg.outer_lr != 0.123
    assert "outer_lr: stored" in caplog.text and "given 0.123" in caplog.text


def test_a_full_state_directory_is_logged_shown_and_retried_without_losing_a_round(tmp_path, monkeypatch, caplog):
    core, session = run(tmp_path, rounds=1)
    real = atomic.os.replace

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device", str(dst))

    monkeypatch.setattr(atomic.os, "replace", full)
    with caplog.at_level(logging.ERROR, logger="diloco.syncer"):
        push_value(core, "a", session, 2)
        assert len(core.poll()) == 1  # the round is closed and published all the same
    assert core.fragments[1].version == 2
    assert "[Errno 28]" in core.state_error and str(tmp_path) in core.state_error
    assert "cannot write the syncer state" in caplog.text and "[Errno 28]" in caplog.text
    assert make_core(tmp_path).restore() and make_core(tmp_path).store.load().ledger["versions"][1] == 1
    monkeypatch.setattr(atomic.os, "replace", real)
    core.persist([0])  # the next round's write (another fragment) also writes what was left unsaved
    assert core.state_error is None
    restarted = make_core(tmp_path)
    assert restarted.restore() and restarted.fragments[1].version == 2
    assert torch.equal(restarted.fragments[1].outer_values(), core.fragments[1].outer_values())


def _state_blocked(state: Path, generation: int):
    """Make the next ledger unwritable even for root: a folder where its temporary file goes."""
    for g in range(generation + 1, generation + 50):
        (state / f"ledger-{g}.json.tmp").mkdir()


def test_an_unwritable_state_directory_marks_the_syncer_unhealthy_and_the_final_model_falls_back(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "fallback-root"))
    (tmp_path / "fallback-root").mkdir()
    out = tmp_path / "out"
    cfg = for_mode("decoupled", 1, fragments=3, sync_every=6, codec="fp32", grace=0.0)
    syncer = SyncerThread(cfg, ServerOptions(listen="127.0.0.1:0", http=None, out=out))
    try:
        core = syncer.service.core
        flats = [torch.arange(f.numel, dtype=torch.float32) for f in plan_fragments(SPECS, 3)]
        assert syncer.service._pool.submit(core.initialize, SPECS, flats).result()
        _state_blocked(out / "state", core.store.generation)
        (out / "model.safetensors.tmp").mkdir()  # nor can the output folder take the final model
        (out / "syncer.json.tmp").mkdir()
        session = syncer.service._pool.submit(core.join, "a", SPECS).result()
        syncer.service._pool.submit(push_value, core, "a", session, 1).result()
        deadline = time.monotonic() + 20
        while syncer.status.get("healthy", True) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert syncer.status["healthy"] is False and "Errno 21" in syncer.status["state_error"]
        assert "ledger-" in syncer.status["state_error"]
    finally:
        result = syncer.stop()
    assert result["healthy"] is False and result["versions"][1] == 1
    final = result["final_model"]
    assert final.startswith(str(tmp_path / "fallback-root")) and final.endswith("model.safetensors")
    model = load_file(final)
    assert set(model) == {"emb", "w1", "w2"}
    assert json.loads((tmp_path / "fallback-root").glob("*/syncer.json").__next__().read_text())["rounds"] == 1


def test_the_syncer_refuses_damaged_state_at_start_and_recovers_when_told(tmp_path):
    core, _ = run(tmp_path / "state")
    newest = manifest(tmp_path / "state")
    (tmp_path / "state" / newest["files"]["ledger"]).write_text("{}")
    cfg = for_mode("decoupled", 2, fragments=3, sync_every=6, codec="fp32", grace=0.0)
    with pytest.raises(RuntimeError, match=r"ledger-\d+\.json is damaged \(size mismatch.*--state-recover"):
        SyncerThread(cfg, ServerOptions(listen="127.0.0.1:0", http=None, out=tmp_path))
    syncer = SyncerThread(cfg, ServerOptions(listen="127.0.0.1:0", http=None, out=tmp_path, recover=True))
    try:
        assert syncer.status["versions"][1] == core.fragments[1].version - 1 and syncer.status["healthy"] is True
    finally:
        result = syncer.stop()
    assert result["final_model"] == str(tmp_path / "model.safetensors")
    assert make_core(tmp_path / "state").restore()  # consistent again without --state-recover


def test_a_tensor_written_a_piece_at_a_time_loads_whole_and_its_digest_is_the_files(tmp_path):
    values = torch.randn(10_000)
    pieces = atomic.Chunked((10_000,), torch.float32, lambda: (values[lo : lo + 3_000] for lo in range(0, 10_000, 3_000)))
    extra = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    layout = [("theta", torch.float32, (10_000,)), ("extra", torch.int64, (2, 3))]
    digest = atomic.save_tensor_stream(tmp_path / "f.safetensors", layout, [pieces, extra])
    assert digest == atomic.file_digest(tmp_path / "f.safetensors")
    loaded = load_file(str(tmp_path / "f.safetensors"))
    assert torch.equal(loaded["theta"], values) and torch.equal(loaded["extra"], extra)
    short = atomic.Chunked((10_000,), torch.float32, lambda: [values[:9_999]])
    with pytest.raises(ValueError, match="9999 values written, the layout says 10000"):
        atomic.save_tensor_stream(tmp_path / "g.safetensors", layout[:1], [short])


def test_theta_kept_as_published_values_and_a_residual_is_saved_as_their_sum(tmp_path):
    core = make_core(tmp_path)  # int8 down: Θ is P + a bf16 residual after the first round
    core.initialize(SPECS, [torch.arange(f.numel, dtype=torch.float32) for f in plan_fragments(SPECS, 3)])
    session, g = core.join("a", SPECS), torch.Generator().manual_seed(0)
    for seq in (1, 2):
        n = core.fragments[1].fragment.numel
        assert core.push("a", session, seq, 1, core.fragments[1].version, 4, 400,
                         codec.encode(torch.randn(n, generator=g), "fp32")).accepted
        assert core.poll()
    fs = core.fragments[1]
    assert fs.residual is not None and fs.residual.abs().max() > 0
    saved = load_file(str(tmp_path / manifest(tmp_path)["files"]["fragment-1"]))["theta"]
    assert torch.equal(saved, fs.published + fs.residual.float())
