"""benchmarks/gpu/quality.py: its --smoke run end to end (the GPU command's code path at CPU scale) and its refusals
of bad input."""

import json
import math
import subprocess

import pytest
import torch

from benchmarks import child_env, module_command

SCRIPT = module_command("benchmarks.gpu.quality")


def run(*args, timeout=600):
    return subprocess.run([*SCRIPT, *args], env=child_env(), capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_smoke_runs_dp_and_every_arm_with_mixed_hardware(tmp_path):
    proc = run("--smoke", "--out", str(tmp_path), "--learners", "2,3", "--arms", "default,paper-dn2", "--mixed",
               "--qk-norm", "--z-loss", "1e-4")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_quality.json").read_text())
    assert report["commit"] and report["device"] == "cpu" and report["model"]["parameters"] > 0
    assert report["model"]["qk_norm"] and report["model"]["z_loss"] == 1e-4
    (seed,) = report["seeds"]
    names = [r["name"] for r in seed["runs"]]
    assert names == ["default-M2", "default-M2-mixed", "paper-dn2-M2", "paper-dn2-M2-mixed",
                     "default-M3", "default-M3-mixed", "paper-dn2-M3", "paper-dn2-M3-mixed"]
    for r in [seed["dp"], *seed["runs"]]:
        # M = 3 learners of 16 // 3 sequences: the budget in whole learner steps
        assert 0.95 * report["tokens"] <= r["tokens"] <= report["tokens"] and not r["stopped"], r["name"]
        assert math.isfinite(r["final_loss"]), r["name"]
        assert r["final_loss"] < math.log(report["corpus"]["vocab"])  # it learned something
    mixed = next(r for r in seed["runs"] if r["name"] == "default-M3-mixed")
    assert mixed["dtypes"] == ["bfloat16", "float32", "bfloat16"] and mixed["speeds"] == [1.0, 1.0, 0.5]
    assert next(r for r in seed["runs"] if r["name"] == "paper-dn2-M2")["sync"]["momentum_every"] == 2
    assert all(r["rounds"] > 0 and r["training_tokens_per_second"] > 0 for r in seed["runs"])
    table = (tmp_path / "gpu_quality.md").read_text()
    assert "default-M3-mixed" in table and "| 0 | dp |" in table


@pytest.mark.parametrize("args, message", [
    (["--smoke", "--arms", "default,nope"], "unknown arm nope"),
    (["--smoke", "--learners", "2,x"], "comma-separated whole numbers"),
    (["--smoke", "--learners", "0"], "must be positive"),
    (["--model", "5m"], "--corpus is required"),
])
def test_bad_arguments_are_refused_with_what_to_do(args, message):
    proc = run(*args, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_smoke_runs_on_the_gpu(tmp_path):
    proc = run("--smoke", "--device", "cuda", "--out", str(tmp_path), "--learners", "2", "--arms", "default",
               "--compile")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_quality.json").read_text())
    assert report["device"] != "cpu" and math.isfinite(report["seeds"][0]["runs"][0]["final_loss"])
