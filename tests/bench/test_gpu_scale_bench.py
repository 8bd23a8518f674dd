"""benchmarks/gpu/scale.py: its --smoke run end to end (the GPU command's code path at CPU scale), its pure parts
(in benchmarks/gpu/runs.py), and its refusals of bad input."""

import json
import math
import subprocess
from pathlib import Path

import pytest

from benchmarks import child_env, module_command

SCRIPT = module_command("benchmarks.gpu.scale")
from benchmarks.gpu.overhead import count_waits
from benchmarks.gpu.runs import Outcome, first_reach, plan_tokens, quality_rows  # its pure parts
from benchmarks.gpu.setup import PUBLISHED_GAP


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One --smoke run for the tests below: about 30 s of CPU (a syncer process per model size, the profiles)."""
    out = tmp_path_factory.mktemp("gpu_smoke")
    proc = subprocess.run([*SCRIPT, "--smoke", "--out", str(out), "--budget", "240"], env=child_env(),
                          capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads((out / "gpu_scale.json").read_text()), (out / "gpu_scale.md").read_text(), proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)  # the shared smoke run starts here; a loaded machine stretches its wall time
def test_the_smoke_run_reports_every_part_with_finite_figures(smoke):
    report, _, _ = smoke
    assert report["smoke"] and report["device"] == "cpu"
    assert report["corpus"]["train_tokens"] > 10_000 and report["corpus"]["vocab"] == 512
    # quality: dp and four decoupled runs, at equal tokens unless the budget stopped one
    quality = report["quality"]
    assert finite(quality["dp"]["final_loss"]) and quality["dp"]["final_loss"] < math.log(512) + 1
    rows = {r["run"]: r for r in quality["rows"]}
    assert set(rows) == {"decoupled-M2", "decoupled-M2-paper", "decoupled-M4", "decoupled-M4-paper"}
    for name, row in rows.items():
        assert finite(row["final_loss"]) and finite(row["gap_nats"]), name
        assert row["gap_nats"] == pytest.approx(row["final_loss"] - quality["dp"]["final_loss"])
        assert row["published_gap_nats"] == PUBLISHED_GAP[row["learners"]]
    for run in quality["runs"]:
        assert len(run["curve"]) >= 2 and all(finite(loss) for _, loss in run["curve"])
        assert run["preset"] in ("default", "paper") and run["rounds"] > 0
        if not run["stopped"] and not quality["dp"]["stopped"]:
            assert run["tokens"] == quality["dp"]["tokens"] == quality["tokens"]
    paper = next(r for r in quality["runs"] if r["name"] == "decoupled-M4-paper")
    assert paper["sync"]["outer_momentum"] == 0.9 and not paper["sync"]["keep_overlap"]
    # overhead: both sizes measured, with and without the learner, and the sync count of each loop
    overhead = {r["model"]: r for r in report["overhead"]["rows"]}
    assert set(overhead) == {"35m", "124m"}
    for row in overhead.values():
        assert row["parameters"] > 0 and finite(row["plain_tokens_per_second"]) and row["plain_tokens_per_second"] > 0
        assert finite(row["tokens_per_second_ratio"]) and row["pushes"] > 0
        assert isinstance(row["syncs_learner"]["training_thread"], int)  # no CUDA here: counted, and zero
        assert 0 < row["learner_step_host_ms"]["median"] <= row["learner_step_host_ms"]["max"]
    assert overhead["124m"]["parameters"] > overhead["35m"]["parameters"]
    # mixed hardware: the precisions and speeds asked for, the half-speed learner stepping half as often
    equal, mixed = report["mixed"]["runs"]
    assert equal["dtypes"] == ["bfloat16"] * 3 and mixed["dtypes"] == ["bfloat16", "float32", "bfloat16"]
    assert mixed["speeds"] == [1.0, 1.0, 0.5] and finite(mixed["minus_equal"]) and equal["minus_equal"] == 0
    assert mixed["steps"][2] <= mixed["steps"][0] // 2 + 1 and mixed["steps"][0] == mixed["steps"][1]


@pytest.mark.slow
def test_the_table_has_a_row_per_run_and_the_log_shows_progress(smoke):
    report, table, stdout = smoke
    for heading in ("## Quality at equal tokens", "## Learner overhead", "## Mixed hardware", "smoke run"):
        assert heading in table
    assert "| decoupled-M4-paper | 4 | paper |" in table and "+0.069 / +0.031" in table
    assert "| 124m |" in table and "| mixed | bfloat16, float32, bfloat16 | 1.0, 1.0, 0.5 |" in table
    assert "calibration:" in stdout and "plan:" in stdout and "held-out" in stdout


def test_tokens_to_a_loss_are_interpolated_and_unreached_targets_are_none():
    curve = [(100, 3.0), (200, 2.0), (300, 1.5)]
    assert first_reach(curve, 2.5) == pytest.approx(150)
    assert first_reach(curve, 3.5) == 100 and first_reach(curve, 1.0) is None
    dp = Outcome("dp", curve=[(100, 3.0), (200, 2.0)], tokens=200)
    late = Outcome("late", curve=[(100, 3.5), (200, 2.5)], tokens=200, extra=dict(learners=4))
    (row,) = quality_rows(dp, [late])
    assert row["gap_nats"] == pytest.approx(0.5) and row["tokens_to_dp_final"] is None
    assert row["dp_tokens_to_this_final_ratio"] == pytest.approx(150 / 200)  # dp reached 2.5 at 150 tokens


def test_the_plan_fits_the_time_and_never_goes_below_a_curve():
    per_token = {"dp": 1e-6, "decoupled-4": 3e-6}
    q, m = plan_tokens(400, per_token, 4, 2, unit=32768, least=10)
    cost = q * (1e-6 + 2 * (2e-6 + 3e-6)) + m * 2 * 1.5 * 3e-6
    assert q % 32768 == 0 and 0.7 * 400 < cost <= 400
    assert plan_tokens(0.001, per_token, 4, 2, unit=100, least=10) == (1000, 1000)


@pytest.mark.parametrize("argv, message", [
    (["--corpus", "/nonexistent/corpus", "--parts", "quality", "--device", "cpu"], "no corpus at /nonexistent/corpus"),
    (["--device", "cpu"], "--corpus is required"),
    (["--smoke", "--tokens", "lots"], "--tokens must be a positive number"),
    (["--smoke", "--parts", "quality,speed"], "unknown part speed"),
])
def test_bad_input_is_refused_in_one_line(tmp_path, argv, message):
    proc = subprocess.run([*SCRIPT, *argv, "--out", str(tmp_path)], env=child_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and message in proc.stderr


def test_waits_are_counted_on_the_thread_that_waited():
    """The sender thread's waits for its copies must not be filed under the training thread (a profiler trace did)."""
    import contextlib
    import threading

    import torch

    def wait(call):
        with contextlib.suppress(Exception):  # no CUDA here: counted, then the real call fails
            call()

    def body():
        wait(torch.cuda.synchronize)
        other = threading.Thread(target=lambda: (wait(lambda: torch.cuda.Event.synchronize(None)),
                                                 wait(lambda: torch.cuda.Stream.synchronize(None))), name="sender")
        other.start()
        other.join()

    waits = count_waits(body, torch.device("cpu"))
    assert waits["training_thread"] == 1 and set(waits["training_thread_calls"]) == {"torch.cuda.synchronize"}
    assert waits["other_threads"] == 2 and waits["threads"]["sender"] == {"Event.synchronize": 1,
                                                                       "Stream.synchronize": 1}
    assert torch.cuda.synchronize.__name__ == "synchronize"  # restored


@pytest.mark.slow
@pytest.mark.parametrize("flags", [[], ["--split-tensors"], ["--device-codec", "--compile"]])
def test_the_learner_profile_reports_host_times_and_waits_by_thread(tmp_path, flags):
    """benchmarks/gpu/learner_profile.py at CPU scale: the same code the GPU diagnostic runs."""
    proc = subprocess.run([*module_command("benchmarks.gpu.learner_profile"), "--device", "cpu",
                           "--smoke", "--out", str(tmp_path), *flags],
                          env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "learner_profile.json").read_text())
    assert result["split_tensors"] is ("--split-tensors" in flags)
    assert result["device_codec"] is result["compiled"] is ("--compile" in flags)
    assert result["plain"]["learner_host_max"] < result["learner"]["learner_host_median"] <= \
        result["learner"]["learner_host_max"]  # the plain loop never calls the Learner
    assert finite(result["learner"]["wall_per_step"]) and result["waits"]["training_thread"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("grace", [None, 0])
def test_the_mixed_rounds_trace_shows_every_evaluation_and_ends_with_no_round_waiting(tmp_path, grace):
    """benchmarks/gpu/mixed_rounds.py, short: a row per evaluation, rounds that only grow, and after every learner's
    finish no fragment's round still holding a contribution."""
    flags = [] if grace is None else ["--grace-expect-steps", str(grace)]
    proc = subprocess.run([*module_command("benchmarks.gpu.mixed_rounds"), "--tokens", "26880",
                           "--evals", "5", "--out", str(tmp_path), *flags], env=child_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| ") and "," in line]
    assert len(rows) == 5  # four during the run, the last one after every learner's finish
    rounds = [int(r[2]) for r in rows]
    assert rounds == sorted(rounds) and rounds[-1] > 0
    assert rows[-1][3].strip() == "0 of 24"
    summary = proc.stdout.splitlines()[-1]
    assert summary.startswith(f"grace_expect_steps {24 if grace is None else 0}: final ")


@pytest.mark.slow
def test_the_fragment_sizes_benchmark_times_whole_and_split_layouts(tmp_path):
    """benchmarks/learner/fragment_sizes.py on a tiny GPT: a run of each layout, the split one's largest fragment
    smaller than the whole one's (its tied embedding)."""
    out = tmp_path / "sizes.json"
    proc = subprocess.run([*module_command("benchmarks.learner.fragment_sizes"), "--model", "smoke", "--cycles", "1",
                           "--repeats", "1", "--step-ms", "1", "--json", str(out)], env=child_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(out.read_text())["summary"]
    assert summary["split"]["largest_fragment_share"] < 0.5 * summary["whole"]["largest_fragment_share"]
    assert all(0 < s["host_ms_median"] <= s["host_ms_max"] for s in summary.values())


def test_the_gpu_checks_script_says_how_to_call_it_and_refuses_a_machine_without_a_gpu(tmp_path):
    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu_checks.sh"
    usage = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2
    assert "usage: scripts/gpu_checks.sh prepare | learner OUT | overhead OUT | quality OUT" in usage.stderr
    hidden = {**child_env(), "CUDA_VISIBLE_DEVICES": ""}  # a machine with a GPU hides it: torch then sees none
    for part in ("learner", "overhead", "quality"):
        cpu = subprocess.run(["bash", str(script), part, str(tmp_path)], capture_output=True, text=True, timeout=120,
                             env=hidden)
        assert cpu.returncode != 0 and "no CUDA device: run this part on a GPU machine" in cpu.stderr, part
