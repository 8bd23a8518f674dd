"""Hugging Face Trainers as learners through DiLoCoCallback: two Trainer processes train a tiny GPT-2 against a real
syncer process, one is SIGKILLed and resumed from its Trainer checkpoint and rejoins under its id; the global model
learns and loads strictly; through the callback a Trainer pushes exactly what the Learner API pushes; tokens are
counted without padding across gradient accumulation; the budget stops the Trainer and can drive its learning
rate; wrong settings fail at train begin with one line; a torchrun Trainer of two ranks is one learner."""

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from diloco import GrpcTransport, Learner, ServerOptions, SyncerError, SyncerThread, for_mode  # noqa: E402
from diloco.integrations import rejoin  # noqa: E402
from diloco.integrations.budget_lr import decay_tail  # noqa: E402
from diloco.integrations.transformers import DiLoCoCallback  # noqa: E402

from integrations_support import (ROOT, InOrder, Rows, SyncerProcess, collate, examples, final_model,  # noqa: E402
                                  final_pushes, heldout_loss, tiny_gpt2)
from liveness import wait_for  # noqa: E402

WORKER = ROOT / "tests" / "workers" / "hf_trainer.py"
pytestmark = pytest.mark.timeout(600)


def worker(syncer: SyncerProcess, learner_id: str, out: pathlib.Path, *args: str) -> subprocess.Popen:
    log = (out.parent / f"{learner_id}.log").open("a")
    cmd = [sys.executable, str(WORKER), "--syncer", syncer.address, "--id", learner_id, "--out", str(out / learner_id),
           "--summary", str(out / f"{learner_id}.json"), *args]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def finished(proc: subprocess.Popen, log: pathlib.Path, timeout: float = 300) -> None:
    proc.wait(timeout)
    assert proc.returncode == 0, log.read_text()[-4000:]


def checkpoints(folder: pathlib.Path) -> list[int]:
    """Steps of the checkpoints in `folder` whose rejoin record is written."""
    found = (re.fullmatch(r"checkpoint-(\d+)", p.name) for p in folder.glob("checkpoint-*")
             if (p / rejoin.RECORD_FILE).exists())
    return sorted(int(m.group(1)) for m in found if m)


@pytest.mark.slow
def test_two_trainers_learn_one_model_and_a_killed_trainer_rejoins_from_its_checkpoint(tmp_path):
    initial = heldout_loss(tiny_gpt2())
    procs = []
    with SyncerProcess(tmp_path / "syncer", "--fragments", "4", "--sync-every", "8") as syncer:
        try:
            # alice would train 10000 steps: she is killed long before, once a checkpoint holds her record
            alice = worker(syncer, "alice", tmp_path, "--shard", "0", "--steps", "10000", "--save-steps", "8")
            bob = worker(syncer, "bob", tmp_path, "--shard", "1", "--steps", "96")
            # alice's restart, started now so that its imports are done by the time it is told to go
            go = tmp_path / "restart-alice"
            again = worker(syncer, "alice", tmp_path, "--shard", "0", "--save-steps", "8", "--start-when", str(go))
            procs += [alice, bob, again]
            wait_for(lambda: len(checkpoints(tmp_path / "alice")) >= 2
                     and syncer.learner("alice").get("merged", 0) >= 2, timeout=240)
            alice.send_signal(signal.SIGKILL)
            alice.wait(30)
            merged_before = syncer.learner("alice")["merged"]
            last = checkpoints(tmp_path / "alice")[-1]
            assert last < 10000
            # resumed from its newest whole checkpoint (the record is written last), it trains 32 more steps
            (tmp_path / "steps").write_text(f"{last + 32} {tmp_path / 'alice' / f'checkpoint-{last}'}")
            (tmp_path / "steps").rename(go)

            finished(bob, tmp_path / "bob.log")
            finished(again, tmp_path / "alice.log")
            final = syncer.stop()
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(30)

    resumed = json.loads((tmp_path / "alice.json").read_text())
    assert resumed["resumed"]["learner_id"] == "alice" and resumed["resumed"]["data_position"] == last
    assert resumed["steps"] == 32 and resumed["global_step"] == last + 32 and resumed["pushes"] >= 2
    # the ledger's data position is the Trainer's global step: where the merged work of alice's first life ended
    assert 0 < resumed["ledger_position"] <= last + 8
    learners = {x["id"]: x for x in final["learners"]}
    assert learners["alice"]["merged"] > merged_before  # her pushes after the rejoin were merged
    assert learners["alice"]["state"] == learners["bob"]["state"] == "left"
    assert learners["alice"]["data_position"] == last + 32
    bob_summary = json.loads((tmp_path / "bob.json").read_text())
    assert bob_summary["steps"] == 96 and bob_summary["tokens"] == 96 * 8 * 32  # unpadded rows: every token counts

    model = final_model(tmp_path / "syncer")  # strict: every entry of the Trainer's model is in the file
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()  # the head stays tied
    loss = heldout_loss(model)
    assert loss < initial - 1.0, (initial, loss)  # ln(256) = 5.5 falls below 3.5 in these steps


@pytest.mark.slow
def test_a_torchrun_trainer_of_two_ranks_is_one_learner(tmp_path):
    with SyncerProcess(tmp_path / "syncer", "--fragments", "4", "--sync-every", "8") as syncer:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log = tmp_path / "island.log"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(port), str(WORKER), "--syncer", syncer.address, "--id", "island", "--out",
               str(tmp_path / "island"), "--summary", str(tmp_path / "island.json"), "--steps", "24"]
        with log.open("w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                    env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            finished(proc, log)
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


def trainer(model, rows, callback, out: pathlib.Path, steps: int, eval_rows=None, **options) -> Trainer:
    args = dict(output_dir=str(out), max_steps=steps, per_device_train_batch_size=4, learning_rate=3e-3,
                lr_scheduler_type="constant", max_grad_norm=0.0, save_strategy="no", logging_steps=1, report_to=[],
                use_cpu=True, disable_tqdm=True, seed=0)
    args.update(options)
    return Trainer(model=model, args=TrainingArguments(**args), train_dataset=InOrder(rows), data_collator=collate,
                   eval_dataset=Rows(eval_rows) if eval_rows else None, callbacks=[callback] if callback else [])


def streaming_syncer(out: pathlib.Path, **options) -> SyncerThread:
    # streaming: every learner waits for each merge when it is due, so a run is one deterministic trajectory
    cfg = for_mode("streaming", 1, fragments=2, sync_every=4, codec="fp32", down_codec="fp32")
    return SyncerThread(cfg, ServerOptions(listen="127.0.0.1:0", http=None, out=out, **options))


def test_through_the_callback_a_trainer_pushes_exactly_what_the_learner_api_pushes(tmp_path):
    torch.set_num_threads(1)
    steps, batch = 12, 4
    rows = examples(0, 1, steps * batch, padded=True)

    syncer = streaming_syncer(tmp_path / "callback")
    try:
        callback = DiLoCoCallback(syncer.address, "solo")
        run = trainer(tiny_gpt2(), rows, callback, tmp_path / "trainer", steps)
        # The Trainer divides the summed loss by the labels it counts before the model shifts them (86 where the
        # mean has 82); Adam is not quite scale-free (eps), so the hand-written loop would drift by 1e-4. Without
        # loss kwargs the Trainer takes the model's mean loss, as the loop below does.
        run.model_accepts_loss_kwargs = False
        run.train()
    finally:
        via_callback = syncer.stop()

    syncer = streaming_syncer(tmp_path / "api")
    try:  # the same training written by hand: AdamW as the Trainer makes it (fused), the same batches in order
        model = tiny_gpt2()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0, fused=True)
        learner = Learner(model, GrpcTransport(syncer.address), "solo")
        model.train()
        for i in range(steps):
            batch_rows = collate(rows[i * batch:(i + 1) * batch])
            loss = model(**batch_rows).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            learner.step(tokens=int(batch_rows["attention_mask"].sum()), data_position=i + 1)
        learner.finish()
    finally:
        via_api = syncer.stop()

    assert callback.learner.tokens == learner.tokens == sum(int(r["attention_mask"].sum()) for r in rows)
    assert callback.learner.pushes == learner.pushes >= steps // 4 * 2
    ours, theirs = (load_file(tmp_path / name / "model.safetensors") for name in ("callback", "api"))
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    assert [x["tokens"] for x in via_callback["learners"]] == [x["tokens"] for x in via_api["learners"]]


def test_padding_and_gradient_accumulation_count_the_tokens_the_trainer_counts(tmp_path):
    torch.set_num_threads(1)
    steps, batch, accumulation = 6, 4, 3
    rows = examples(0, 1, steps * batch * accumulation, padded=True)
    syncer = SyncerThread(for_mode("decoupled", 1, fragments=2, sync_every=4),
                          ServerOptions(listen="127.0.0.1:0", http=None))
    try:
        callback = DiLoCoCallback(syncer.address, "counted")
        # evaluation calls the model too, every 2 steps: those tokens are not trained on
        run = trainer(tiny_gpt2(), rows, callback, tmp_path, steps, eval_rows=rows[:8], eval_strategy="steps",
                      eval_steps=2, gradient_accumulation_steps=accumulation,
                      include_num_input_tokens_seen="non_padding")
        run.train()
    finally:
        status = syncer.stop()
    non_padding = sum(int(r["attention_mask"].sum()) for r in rows)
    assert non_padding < len(rows) * rows[0]["input_ids"].numel()  # there is padding to leave out
    assert callback.learner.step_count == steps
    assert callback.learner.tokens == non_padding == run.state.num_input_tokens_seen
    assert {x["id"]: x for x in status["learners"]}["counted"]["tokens"] == non_padding


def test_the_budget_stops_the_trainer_and_drives_its_learning_rate(tmp_path):
    torch.set_num_threads(1)
    rows = examples(0, 1, 64)
    tokens_per_step = 4 * 32
    peak, schedule = 3e-3, decay_tail(final=0.1, tail=0.5)
    syncer = SyncerThread(for_mode("decoupled", 1, fragments=2, sync_every=4, heartbeat_seconds=0.05),
                          ServerOptions(listen="127.0.0.1:0", http=None, token_budget=40 * tokens_per_step))
    seen = []  # (learning rate, budget progress as last heard) at each step's start

    class Rates(DiLoCoCallback):
        def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
            seen.append((optimizer.param_groups[0]["lr"], self.learner.budget_progress or 0.0))

    try:
        callback = Rates(syncer.address, "budgeted", lr_schedule=schedule)
        run = trainer(tiny_gpt2(), rows, callback, tmp_path, 1000)
        run.train()
    finally:
        syncer.stop()
    steps = run.state.global_step
    # the syncer hears the tokens at heartbeats (every 50 ms) and says stop at the next one: a few steps late
    assert 40 <= steps < 1000 and callback.learner.should_stop
    rates = [rate for rate, _ in seen]
    assert rates[0] == pytest.approx(peak)  # the first half of the budget holds the rate
    # A step's rate is the schedule at the progress heard when the scheduler stepped after the step before it, which
    # lies between the progress seen at the two steps' starts. How many steps share one heard progress (so how close
    # to the end the last rate is) depends on the machine's speed: 4 steps at 80 steps/s, a tenth of this budget.
    for (rate, now), (_, before) in zip(seen[1:], seen):
        assert peak * schedule(now) - 1e-12 <= rate <= peak * schedule(before) + 1e-12, (rate, now, before)
    assert rates[-1] < peak  # then decayed towards a tenth
    assert all(a >= b for a, b in zip(rates, rates[1:]))
    logged = [x["learning_rate"] for x in run.state.log_history if "learning_rate" in x]
    assert logged == pytest.approx(rates)  # what the Trainer logs: the rate each step used


def test_wrong_settings_fail_at_train_begin_with_one_line(tmp_path):
    torch.set_num_threads(1)
    rows = examples(0, 1, 16)

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = trainer(tiny_gpt2(), rows, DiLoCoCallback(f"127.0.0.1:{port}", "x", connect_timeout=1.0), tmp_path / "x", 4)
    started = time.monotonic()
    with pytest.raises(SyncerError, match="cannot reach the syncer at .* start it with `diloco syncer") as e:
        run.train()
    assert time.monotonic() - started < 30 and run.state.global_step == 0 and "\n" not in str(e.value)

    syncer = SyncerThread(for_mode("decoupled", 2, fragments=2, sync_every=4),
                          ServerOptions(listen="127.0.0.1:0", http=None))
    try:
        first = Learner(tiny_gpt2(), GrpcTransport(syncer.address), "first")  # the run's model: the tiny GPT-2
        try:
            wider = tiny_gpt2()
            wider.resize_token_embeddings(300)  # not the run's model: its embedding has more rows
            run = trainer(wider, rows, DiLoCoCallback(syncer.address, "wider"), tmp_path / "wider", 4)
            with pytest.raises(SyncerError, match="wte") as e:
                run.train()
            assert run.state.global_step == 0 and "\n" not in str(e.value)
            with pytest.raises(ValueError, match="has none: start it with --tokens or --duration"):
                trainer(tiny_gpt2(), rows, DiLoCoCallback(syncer.address, "sched", lr_schedule=decay_tail()),
                        tmp_path / "sched", 4).train()

            # a checkpoint of learner "a" resumed under another id
            trainer(tiny_gpt2(), rows, DiLoCoCallback(syncer.address, "a"), tmp_path / "a", 4, save_strategy="steps",
                    save_steps=2).train()
            assert rejoin.read(tmp_path / "a" / "checkpoint-4").learner_id == "a"
            run = trainer(tiny_gpt2(), rows, DiLoCoCallback(syncer.address, "b"), tmp_path / "a", 6)
            with pytest.raises(ValueError, match="pass learner_id='a' to resume it"):
                run.train(resume_from_checkpoint=True)
            assert run.state.global_step == 4  # resumed, and stopped before training a step
        finally:
            first.close()
    finally:
        syncer.stop()


@pytest.mark.slow
def test_a_sigtermed_trainer_pushes_what_it_has_and_leaves_saying_so(tmp_path):
    syncer = SyncerThread(for_mode("decoupled", 1, fragments=4, sync_every=8),
                          ServerOptions(listen="127.0.0.1:0", http=None, out=tmp_path / "syncer"))
    proc = None
    try:
        (tmp_path / "w").mkdir()  # the worker's log goes beside its folder
        proc = worker(syncer, "alice", tmp_path / "w", "--steps", "10000", "--save-steps", "100000")
        wait_for(lambda: {x["id"]: x for x in syncer.status.get("learners", [])}.get("alice", {}).get("merged", 0)
                 >= 2, timeout=240)
        proc.send_signal(signal.SIGTERM)
        finished(proc, tmp_path / "alice.log")  # the Trainer stopped after the step: train() returned, status 0
        wait_for(lambda: {x["id"]: x for x in syncer.status.get("learners", [])}["alice"].get("state") == "left")
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(30)
        syncer.stop()
    assert final_pushes(tmp_path / "syncer" / "tape.jsonl", "alice")  # its last pushes, made after the signal
    log = (tmp_path / "alice.log").read_text()
    assert log.count("diloco: learner alice got SIGTERM: it pushes what it has and leaves the run") == 1
    assert log.count("diloco: learner alice left the run after") == 1
    summary = json.loads((tmp_path / "w" / "alice.json").read_text())
    assert 0 < summary["global_step"] < 10000
