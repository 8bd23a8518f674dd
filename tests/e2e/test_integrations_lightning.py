"""Lightning Trainers as learners through DiLoCoCallback: a Lightning learner is SIGKILLed and resumed from its
Lightning checkpoint, rejoins under its id and trains beside a second one against a real syncer process; the global
model learns and loads strictly; through the callback a Trainer with gradient accumulation pushes exactly what the
Learner API pushes; the budget stops the Trainer and sets its learning rate; a DDP Trainer is one learner."""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lightning")
pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from diloco import GrpcTransport, Learner, ServerOptions, SyncerThread, for_mode  # noqa: E402
from diloco.integrations.budget_lr import decay_tail  # noqa: E402
from diloco.integrations.lightning import DiLoCoCallback  # noqa: E402

from integrations_support import (ROOT, SyncerProcess, examples, final_model, final_pushes,  # noqa: E402
                                  heldout_loss, lightning_module, lightning_trainer, loader, tiny_gpt2)
from liveness import wait_for  # noqa: E402

WORKER = ROOT / "tests" / "workers" / "lightning_fit.py"
pytestmark = pytest.mark.timeout(600)


def worker(syncer: SyncerProcess, learner_id: str, out: pathlib.Path, *args: str) -> subprocess.Popen:
    log = (out / f"{learner_id}.log").open("a")
    cmd = [sys.executable, str(WORKER), "--syncer", syncer.address, "--id", learner_id, "--out", str(out / learner_id),
           "--summary", str(out / f"{learner_id}.json"), *args]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def saved_steps(folder: pathlib.Path) -> list[int]:
    found = (re.fullmatch(r"step=(\d+)\.ckpt", p.name) for p in folder.glob("step=*.ckpt"))
    return sorted(int(m.group(1)) for m in found if m)


@pytest.mark.slow
def test_a_killed_lightning_learner_rejoins_from_its_checkpoint_beside_another(tmp_path):
    torch.set_num_threads(1)
    initial = heldout_loss(tiny_gpt2())
    procs = []
    with SyncerProcess(tmp_path / "syncer", "--fragments", "4", "--sync-every", "8") as syncer:
        try:
            alice = worker(syncer, "alice", tmp_path, "--shard", "0", "--steps", "10000", "--save-steps", "8")
            go = tmp_path / "restart-alice"  # the restart, its imports done by the time it is told to go
            again = worker(syncer, "alice", tmp_path, "--shard", "0", "--save-steps", "8", "--start-when", str(go))
            procs += [alice, again]
            wait_for(lambda: len(saved_steps(tmp_path / "alice")) >= 3
                     and syncer.learner("alice").get("merged", 0) >= 2, timeout=240)
            alice.send_signal(signal.SIGKILL)
            alice.wait(30)
            merged_before = syncer.learner("alice")["merged"]
            last = saved_steps(tmp_path / "alice")[-2]  # the newest may be half-written: the kill can come any time
            (tmp_path / "steps").write_text(f"{last + 32} {tmp_path / 'alice' / f'step={last}.ckpt'}")
            (tmp_path / "steps").rename(go)

            # bob trains in this process meanwhile, a second learner of the run
            bob = DiLoCoCallback(syncer.address, "bob")
            lightning_trainer(tmp_path / "bob", 64, [bob]).fit(lightning_module(), loader(examples(1, 2, 256), 8))
            again.wait(300)
            assert again.returncode == 0, (tmp_path / "alice.log").read_text()[-4000:]
            final = syncer.stop()
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(30)

    resumed = json.loads((tmp_path / "alice.json").read_text())
    assert resumed["resumed"]["learner_id"] == "alice" and resumed["resumed"]["data_position"] == last
    assert resumed["steps"] == 32 and resumed["global_step"] == last + 32 and resumed["pushes"] >= 2
    assert 0 < resumed["ledger_position"]  # the syncer's ledger had her first life's merged work
    learners = {x["id"]: x for x in final["learners"]}
    assert learners["alice"]["merged"] > merged_before  # her pushes after the rejoin were merged
    assert learners["alice"]["state"] == learners["bob"]["state"] == "left"
    assert learners["alice"]["data_position"] == last + 32
    assert bob.learner.step_count == 64 and bob.learner.tokens == 64 * 8 * 32

    model = final_model(tmp_path / "syncer", build=lambda seed: lightning_module(tiny_gpt2(seed)))
    loss = heldout_loss(model.model)
    assert loss < initial - 1.0, (initial, loss)


@pytest.mark.slow
def test_a_ddp_trainer_of_two_ranks_is_one_learner(tmp_path):
    with SyncerProcess(tmp_path / "syncer", "--fragments", "4", "--sync-every", "8") as syncer:
        proc = worker(syncer, "island", tmp_path, "--steps", "24", "--devices", "2")  # strategy="ddp", 2 CPU ranks
        try:
            proc.wait(300)
            assert proc.returncode == 0, (tmp_path / "island.log").read_text()[-4000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
        final = syncer.stop()
    ranks = [json.loads((tmp_path / f"island.json.{rank}").read_text()) for rank in (0, 1)]
    assert ranks[0]["ranks"] == 2 and ranks[0]["digest"] == ranks[1]["digest"]  # DDP ranks stay bit-identical
    assert ranks[0]["pushes"] >= 2 and ranks[1]["pushes"] == 0  # rank 0 alone talks to the syncer
    learners = {x["id"]: x for x in final["learners"]}
    assert list(learners) == ["island"]  # one learner, whose tokens are both ranks'
    assert learners["island"]["tokens"] == ranks[0]["tokens"] == 24 * 2 * 8 * 32
    assert learners["island"]["merged"] >= 2 and learners["island"]["state"] == "left"


def streaming_syncer(out: pathlib.Path, **options) -> SyncerThread:
    # streaming: the learner waits for each merge when it is due, so a run is one deterministic trajectory
    cfg = for_mode("streaming", 1, fragments=2, sync_every=4, codec="fp32", down_codec="fp32")
    return SyncerThread(cfg, ServerOptions(listen="127.0.0.1:0", http=None, out=out, **options))


def test_through_the_callback_lightning_pushes_exactly_what_the_learner_api_pushes(tmp_path):
    torch.set_num_threads(1)
    steps, batch, accumulation = 8, 4, 2
    rows = examples(0, 1, steps * batch * accumulation, padded=True)

    syncer = streaming_syncer(tmp_path / "callback")
    try:
        callback = DiLoCoCallback(syncer.address, "solo")
        lightning_trainer(tmp_path / "fit", steps, [callback], accumulate_grad_batches=accumulation).fit(
            lightning_module(), loader(rows, batch))
    finally:
        syncer.stop()

    syncer = streaming_syncer(tmp_path / "api")
    try:  # the same training by hand: Lightning divides each micro-batch's loss by the accumulation
        module = lightning_module()
        optimizer = module.configure_optimizers()
        learner = Learner(module, GrpcTransport(syncer.address), "solo")
        module.train()
        batches = iter(loader(rows, batch))
        for i in range(steps):
            optimizer.zero_grad()
            tokens = 0
            for _ in range(accumulation):
                b = next(batches)
                (module.training_step(b, 0) / accumulation).backward()
                tokens += int(b["attention_mask"].sum())
            optimizer.step()
            learner.step(tokens, data_position=i + 1)
        learner.finish()
    finally:
        syncer.stop()

    assert callback.learner.tokens == learner.tokens == sum(int(r["attention_mask"].sum()) for r in rows)
    assert callback.learner.step_count == steps and callback.learner.pushes == learner.pushes >= steps // 4 * 2
    ours, theirs = (load_file(tmp_path / name / "model.safetensors") for name in ("callback", "api"))
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


def test_the_budget_stops_lightning_and_sets_its_learning_rate(tmp_path):
    torch.set_num_threads(1)
    rows = examples(0, 1, 64)
    tokens_per_step = 4 * 32
    peak, schedule = 3e-3, decay_tail(final=0.1, tail=0.5)
    syncer = SyncerThread(for_mode("decoupled", 1, fragments=2, sync_every=4, heartbeat_seconds=0.05),
                          ServerOptions(listen="127.0.0.1:0", http=None, token_budget=80 * tokens_per_step))
    seen = []  # (learning rate, budget progress as last heard) at each batch's start

    class Rates(DiLoCoCallback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append((trainer.optimizers[0].param_groups[0]["lr"], self.learner.budget_progress or 0.0))

    try:
        callback = Rates(syncer.address, "budgeted", lr_schedule=schedule)
        trainer = lightning_trainer(tmp_path, 1000, [callback])
        trainer.fit(lightning_module(), loader(rows, 4))
    finally:
        syncer.stop()
    # the syncer hears the tokens at heartbeats (every 50 ms) and says stop at the next one: a few steps late
    assert 80 <= trainer.global_step < 1000 and callback.learner.should_stop
    rates = [rate for rate, _ in seen]
    assert rates[0] == pytest.approx(peak)  # with no scheduler the callback sets the rate: held for half the budget
    # A step's rate is the schedule at the progress heard just after the step before it, which lies between the
    # progress seen at the two batches' starts. How many steps share one heard progress depends on the machine's load.
    for (rate, now), (_, before) in zip(seen[1:], seen):
        assert peak * schedule(now) - 1e-12 <= rate <= peak * schedule(before) + 1e-12, (rate, now, before)
    assert rates[-1] < peak  # then decayed towards a tenth
    assert all(a >= b for a, b in zip(rates, rates[1:]))


def test_a_checkpoint_of_another_learner_is_refused_at_train_start(tmp_path):
    torch.set_num_threads(1)
    rows = examples(0, 1, 16)
    syncer = SyncerThread(for_mode("decoupled", 2, fragments=2, sync_every=4),
                          ServerOptions(listen="127.0.0.1:0", http=None))
    try:
        trainer = lightning_trainer(tmp_path, 4, [DiLoCoCallback(syncer.address, "a")])
        trainer.fit(lightning_module(), loader(rows, 4))
        trainer.save_checkpoint(tmp_path / "a.ckpt")
        other = lightning_trainer(tmp_path, 8, [DiLoCoCallback(syncer.address, "b")])
        with pytest.raises(ValueError, match="pass learner_id='a' to resume it"):
            other.fit(lightning_module(), loader(rows, 4), ckpt_path=tmp_path / "a.ckpt")
        assert other.global_step == 4  # restored, and stopped before training a step
    finally:
        syncer.stop()


def status_of(syncer: SyncerThread, learner_id: str) -> dict:
    return {x["id"]: x for x in syncer.status.get("learners", [])}.get(learner_id, {})


def finished_worker(proc: subprocess.Popen, log: pathlib.Path) -> str:
    proc.wait(300)
    assert proc.returncode == 0, log.read_text()[-4000:]
    return log.read_text()


@pytest.mark.slow
def test_a_sigtermed_lightning_learner_pushes_what_it_has_and_leaves_saying_so(tmp_path):
    syncer = SyncerThread(for_mode("decoupled", 1, fragments=4, sync_every=8),
                          ServerOptions(listen="127.0.0.1:0", http=None, out=tmp_path / "syncer"))
    proc = None
    try:
        proc = worker(syncer, "alice", tmp_path, "--steps", "10000", "--save-steps", "100000")
        wait_for(lambda: status_of(syncer, "alice").get("merged", 0) >= 2, timeout=240)
        proc.send_signal(signal.SIGTERM)
        log = finished_worker(proc, tmp_path / "alice.log")  # Lightning ends fit() with SystemExit: status 0
        wait_for(lambda: status_of(syncer, "alice").get("state") == "left")
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(30)
        syncer.stop()
    assert final_pushes(tmp_path / "syncer" / "tape.jsonl", "alice")  # its last pushes, made after the signal
    assert log.count("diloco: learner alice got SIGTERM: it pushes what it has and leaves the run") == 1
    assert log.count("diloco: learner alice left the run after") == 1


@pytest.mark.slow
def test_a_lightning_learners_key_lines_reach_stderr_without_logging_configured(tmp_path):
    tokens_per_step = 8 * 32
    syncer = SyncerThread(for_mode("decoupled", 1, fragments=2, sync_every=4, heartbeat_seconds=0.1),
                          ServerOptions(listen="127.0.0.1:0", http=None, token_budget=32 * tokens_per_step))
    try:
        first = finished_worker(worker(syncer, "alice", tmp_path, "--steps", "16", "--save-steps", "8"),
                                tmp_path / "alice.log")
        (tmp_path / "alice.log").unlink()
        resumed = finished_worker(worker(syncer, "alice", tmp_path, "--steps", "10000", "--save-steps", "100000",
                                         "--resume", str(tmp_path / "alice" / "step=8.ckpt")),
                                  tmp_path / "alice.log")
    finally:
        syncer.stop()
    assert first.count("diloco: learner alice joined the run at") == 1 and "resumed" not in first
    assert first.count("diloco: learner alice left the run after 16 steps") == 1
    assert resumed.count("diloco: learner alice joined the run at") == 1
    assert "resumed from step 8 (" in resumed
    assert resumed.count("diloco: learner alice: the run's budget is spent: stopping the training after step") == 1
    assert resumed.count("diloco: learner alice left the run after") == 1
