"""An Accelerate loop as a learner (examples/accelerate_loop.py): two learners train one tiny GPT-2 against a real
syncer process while one is SIGKILLed and started again, rejoining under its id where its merged data ended; the
global model learns and loads strictly; an Accelerate job of two processes is one learner; with gradient
accumulation the loop pushes exactly what a plain loop with the Learner API pushes."""

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from diloco import GrpcTransport, Learner, ServerOptions, SyncerThread, for_mode  # noqa: E402
from diloco.train.data import ShardSampler  # noqa: E402

from integrations_support import ROOT, SyncerProcess, final_model, heldout_loss  # noqa: E402
from liveness import wait_for  # noqa: E402

EXAMPLE = ROOT / "examples" / "accelerate_loop.py"
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("accelerate_loop", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_example(syncer: SyncerProcess, learner_id: str, out, *args: str) -> subprocess.Popen:
    log = (out / f"{learner_id}.log").open("a")
    cmd = [sys.executable, str(EXAMPLE), "--syncer", syncer.address, "--id", learner_id, "--num-shards", "2",
           "--summary", str(out / f"{learner_id}.json"), *args]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_two_accelerate_learners_learn_and_a_killed_one_rejoins_where_its_data_ended(example, tmp_path):
    torch.set_num_threads(1)
    initial = heldout_loss(example.build_model())
    procs = []
    with SyncerProcess(tmp_path / "syncer", "--fragments", "4", "--sync-every", "8") as syncer:
        try:
            alice = run_example(syncer, "alice", tmp_path, "--shard", "0", "--steps", "10000")
            bob = run_example(syncer, "bob", tmp_path, "--shard", "1", "--steps", "64", "--accumulation", "2")
            procs += [alice, bob]
            wait_for(lambda: syncer.learner("alice").get("merged", 0) >= 2, timeout=240)
            alice.send_signal(signal.SIGKILL)
            alice.wait(30)
            merged = syncer.learner("alice")
            # alice again, in this process: it joins under its id, takes the global model, and resumes its data
            # where the syncer's ledger says her merged work ended
            again = example.main(syncer.address, "alice", steps=32, shard=0, num_shards=2)
            bob.wait(300)
            assert bob.returncode == 0, (tmp_path / "bob.log").read_text()[-4000:]
            final = syncer.stop()
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(30)

    # pushes alice made before the kill may still be merged after it: the ledger only moves on
    assert 0 < merged["data_position"] <= again.start_position
    assert again.steps == 32 and again.pushes >= 2
    learners = {x["id"]: x for x in final["learners"]}
    assert learners["alice"]["merged"] > merged["merged"]  # her pushes after the rejoin were merged
    assert learners["alice"]["data_position"] == again.start_position + 32 * 8  # 8 sequences a step
    bob_summary = json.loads((tmp_path / "bob.json").read_text())
    assert bob_summary["steps"] == 64 and bob_summary["tokens"] == 64 * 2 * 8 * example.SEQ_LEN

    loss = heldout_loss(final_model(tmp_path / "syncer", build=example.build_model))
    assert loss < initial - 1.0, (initial, loss)


@pytest.mark.slow
def test_an_accelerate_job_of_two_processes_is_one_learner(tmp_path):
    with SyncerProcess(tmp_path / "syncer", "--fragments", "4", "--sync-every", "8") as syncer:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(port), str(EXAMPLE), "--syncer", syncer.address, "--id", "island", "--cpu",
               "--steps", "16", "--accumulation", "2", "--summary", str(tmp_path / "island.json")]
        with (tmp_path / "island.log").open("w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            proc.wait(300)
            assert proc.returncode == 0, (tmp_path / "island.log").read_text()[-4000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
        final = syncer.stop()
    summary = json.loads((tmp_path / "island.json").read_text())
    learners = {x["id"]: x for x in final["learners"]}
    assert list(learners) == ["island"]  # one learner, whose tokens are both processes'
    assert learners["island"]["tokens"] == summary["tokens"] == 16 * 2 * 2 * 8 * 32
    assert summary["pushes"] >= 2 and learners["island"]["merged"] >= 2 and learners["island"]["state"] == "left"


def test_an_accelerate_loop_pushes_exactly_what_a_plain_loop_pushes(example, tmp_path):
    torch.set_num_threads(1)
    steps, batch, accumulation = 8, 4, 2

    def syncer(out):  # streaming: the learner waits for each merge when due, one deterministic trajectory
        cfg = for_mode("streaming", 1, fragments=2, sync_every=4, codec="fp32", down_codec="fp32")
        return SyncerThread(cfg, ServerOptions(listen="127.0.0.1:0", http=None, out=out))

    run = syncer(tmp_path / "accelerate")
    try:
        ours = example.main(run.address, "solo", steps=steps, batch_size=batch, accumulation=accumulation)
    finally:
        run.stop()

    run = syncer(tmp_path / "plain")
    try:
        model = example.build_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0, fused=True)
        learner = Learner(model, GrpcTransport(run.address), "solo")
        data = ShardSampler(example.corpus().train, 0, 1, example.SEQ_LEN, batch, seed=0)
        model.train()
        for _ in range(steps):
            for _ in range(accumulation):  # Accelerate divides each micro-batch's loss by the accumulation
                x, _ = data.next_batch()
                (model(input_ids=x, labels=x).loss / accumulation).backward()
            optimizer.step()
            optimizer.zero_grad()
            learner.step(accumulation * x.numel(), data_position=data.position)
        learner.finish()
    finally:
        run.stop()

    assert ours.tokens == learner.tokens == steps * accumulation * batch * example.SEQ_LEN
    assert ours.pushes == learner.pushes >= steps // 4 * 2
    a, b = (load_file(tmp_path / name / "model.safetensors") for name in ("accelerate", "plain"))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
