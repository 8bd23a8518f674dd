"""Real processes on loopback: `diloco run` with a syncer and learners, and the data-parallel baseline."""

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def diloco_run(tmp_path, *flags):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "diloco", "run", "--model", "tiny", "--json", "--out", str(out), *flags],
                          capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout), out


def test_syncer_and_three_learners_one_slow_every_fragment_advances(tmp_path):
    report, out = diloco_run(tmp_path, "--learners", "3", "--speeds", "1,1,0.25", "--steps", "40",
                             "--fragments", "4", "--sync-every", "8")
    syncer = json.loads((out / "syncer" / "syncer.json").read_text())
    assert all(v >= 1 for v in syncer["versions"]), syncer["versions"]  # every fragment advanced
    slow = next(x for x in syncer["learners"] if x["id"] == "learner-2")
    assert slow["merged"] >= 1 and slow["tokens_merged"] > 0  # the slow learner's work reached the global model
    for learner in report["per_learner"]:
        assert learner["exit_code"] == 0 and learner["steps"] == 40
        # H = 8, P = 4: a push every second schedule position, each sent or skipped (one in flight); 40 steps
        # pass 40 positions, give or take the shifts that keep a learner in phase with its peers
        assert abs(learner["schedule_position"] - 40) <= 8
        assert learner["pushes"] - learner["flushed"] + learner["skipped"] == learner["schedule_position"] // 2
    assert report["final_eval_loss"] < report["initial_eval_loss"]
    assert report["rounds"] == sum(syncer["versions"]) and report["wire_bytes"] > 0
    parts = report["wire_parts"]  # every byte the syncer counted, by call and part
    assert sum(n for by_part in parts.values() for n in by_part.values()) == report["wire_bytes"]
    assert set(parts["push"]) == {"payload:int4", "framing"} and set(parts["heartbeat"]) == {"framing"}
    assert parts["downlink"]["payload:int8"] > parts["downlink"]["framing"] > 0
    # one learner uploaded the model; none was sent it, since each built the same one from the seed (its digests)
    assert parts["init"]["payload:fp32"] >= 4 * report["model_parameters"]
    assert "payload:fp32" not in parts["join"] and parts["join"]["framing"] < 4 * report["model_parameters"]
    bytes_seen = [p["wire_bytes"] for p in report["eval_curve"][1:]]  # at each snapshot: bytes to each quality
    assert bytes_seen == sorted(bytes_seen) and 0 < bytes_seen[-1] <= report["wire_bytes"]
    for name in ("report.json", "eval_loss.png", "model.safetensors", "sample.txt", "metrics/learner-2.jsonl"):
        assert (out / name).exists(), name
    assert len(report["eval_curve"]) >= 3
    # the straggler slows no one: the others' 40 steps take far less time than its own 40
    span = {}
    for i in range(3):
        times = [json.loads(line)["t"] for line in (out / "metrics" / f"learner-{i}.jsonl").read_text().splitlines()]
        span[i] = times[-1] - times[0]
    assert max(span[0], span[1]) < 0.7 * span[2], span


def test_dp_baseline_counts_ring_allreduce_bytes(tmp_path):
    report, out = diloco_run(tmp_path, "--mode", "dp", "--learners", "2", "--steps", "12")
    n = report["model_parameters"]
    assert report["rounds"] == 12 and report["tokens_trained"] == 2 * 12 * 16 * 64
    assert report["wire_bytes"] == 2 * (2 * (2 - 1) / 2 * 4 * n) * 12
    assert report["final_eval_loss"] < report["initial_eval_loss"]
    # unpaced, goodput and uptime measure how steadily this machine ran the steps: checked against their definition
    rates = sum(x["healthy_tokens_per_second"] for x in report["per_learner"])
    wall = report["wall_seconds"]  # rounded to the millisecond, and 12 tiny steps can take a quarter of a second
    low, high = (report["tokens_merged"] / (rates * (wall + d)) for d in (5e-4, -5e-4))
    assert low * (1 - 1e-9) <= report["goodput"] <= high * (1 + 1e-9), (low, report["goodput"], high)
    assert 0 < report["goodput"] and 0 < report["uptime"] <= 1


def test_learners_of_two_ranks_each_train_as_torchrun_jobs(tmp_path):
    report, out = diloco_run(tmp_path, "--learners", "2", "--ranks-per-learner", "2", "--steps", "16",
                             "--fragments", "4", "--sync-every", "8", "--batch-size", "8")
    per_step = 8 * 64  # the tiny model's sequences of 64 tokens, 8 per rank
    for learner in report["per_learner"]:
        assert learner["exit_code"] == 0 and learner["ranks"] == 2 and learner["steps"] == 16
        assert learner["tokens"] == 16 * 2 * per_step  # both ranks' batches count
        assert learner["applied"] >= 1
    syncer = json.loads((out / "syncer" / "syncer.json").read_text())
    assert min(syncer["versions"][:4]) >= 1
    assert report["final_eval_loss"] < report["initial_eval_loss"]


def test_paced_learners_have_fixed_capacities_and_goodput_at_most_one(tmp_path):
    report, out = diloco_run(tmp_path, "--learners", "2", "--speeds", "1,0.5", "--steps", "12", "--pace", "0.1",
                             "--fragments", "2", "--sync-every", "4")
    assert report["pace"] == 0.1 and "allocated = tokens per step × speed / pace" in report["goodput_basis"]
    tokens_per_step = 16 * 64
    allocated = {x["id"]: x["allocated_tokens_per_second"] for x in report["per_learner"]}
    assert allocated == {"learner-0": tokens_per_step / 0.1, "learner-1": tokens_per_step * 0.5 / 0.1}
    for i, target in ((0, 0.1), (1, 0.2)):  # every step padded to pace / speed
        busy = [json.loads(line)["busy"] for line in (out / "metrics" / f"learner-{i}.jsonl").read_text().splitlines()]
        assert len(busy) == 12 and min(busy) >= target * 0.98, busy
    assert 0 < report["goodput"] <= 1


def test_a_run_with_two_syncer_shards_trains_and_reports_as_one(tmp_path):
    report, out = diloco_run(tmp_path, "--learners", "2", "--syncer-shards", "2", "--steps", "48",
                             "--fragments", "4", "--sync-every", "4", "--initial-model", "file")
    assert (out / "initial-model.safetensors").exists()  # each shard started from it: no model crossed the wire
    assert "init" not in report["wire_parts"] and "payload:fp32" not in report["wire_parts"]["join"]
    shards = [json.loads((out / "syncer" / f"shard-{i}" / "syncer.json").read_text()) for i in range(2)]
    assert [s["owned_fragments"] for s in shards] == [[0, 2], [1, 3]]
    combined = json.loads((out / "syncer" / "syncer.json").read_text())
    assert all(v >= 1 for v in combined["versions"]), combined["versions"]  # every fragment advanced, at its shard
    assert combined["rounds"] == sum(s["rounds"] for s in shards) == report["rounds"]
    assert report["final_eval_loss"] < report["initial_eval_loss"]  # the model assembled from both shards
    assert all(learner["exit_code"] == 0 and learner["steps"] == 48 for learner in report["per_learner"])


def test_a_run_writes_tensorboard_curves_for_each_learner_and_the_global_model(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = tmp_path / "board"
    report, out = diloco_run(tmp_path, "--learners", "2", "--steps", "12", "--fragments", "2", "--sync-every", "4",
                             "--tensorboard", str(board))
    for lid in ("learner-0", "learner-1"):
        events = EventAccumulator(str(board / lid))
        events.Reload()
        losses = events.Scalars("learner/loss")
        assert [e.step for e in losses] == list(range(1, 13))
    events = EventAccumulator(str(board / "global"))
    events.Reload()
    curve = events.Scalars("global/eval_loss_by_tokens_trained")
    assert len(curve) == len(report["eval_curve"]) and curve[-1].value == pytest.approx(report["eval_curve"][-1]["eval_loss"])
