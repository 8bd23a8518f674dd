"""`diloco compare --tokens`: every mode trains exactly the same tokens."""

import json
import subprocess
import sys

import pytest

from diloco.procs import die_with_parent

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def test_every_mode_trains_the_same_tokens(tmp_path):
    # 2 learners of 1,024-token steps: 8,192 tokens are 4 whole steps each, in every mode
    proc = subprocess.run([sys.executable, "-m", "diloco", "compare", "--modes", "decoupled,dp", "--learners", "2",
                           "--tokens", "8192", "--model", "tiny", "--out", str(tmp_path / "cmp")],
                          capture_output=True, text=True, timeout=560, preexec_fn=die_with_parent())
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert summary["budget"] == "same budget: 4 steps × 2 learners × 1,024 tokens = 8,192 tokens per mode"
    assert {m: (r["tokens_trained"], r["tokens_merged"]) for m, r in summary["modes"].items()} == {
        "decoupled": (8192, 8192), "dp": (8192, 8192)}
