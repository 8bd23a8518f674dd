"""benchmarks/learner/codec_speed.py, small: a line per codec with its encode time, decode times for the block
codecs, and a clear refusal of bad input."""

import re
import subprocess

from benchmarks import child_env, module_command

SCRIPT = module_command("benchmarks.learner.codec_speed")


def test_every_codec_is_timed_on_a_small_fragment():
    proc = subprocess.run([*SCRIPT, "--values", "100003", "--repeats", "1"], env=child_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = {m.group(1): m.group(0) for m in re.finditer(r"^\s+(fp32|bf16|int8|int4)\s+encode Δ\s+[\d.]+ ms.*$",
                                                          proc.stdout, re.M)}
    assert set(lines) == {"fp32", "bf16", "int8", "int4"}, proc.stdout
    assert all("decode into a reused chunk" in lines[c] for c in ("int8", "int4"))


def test_bad_input_is_refused_in_one_line():
    proc = subprocess.run([*SCRIPT, "--values", "0"], env=child_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--values and --repeats must be positive" in proc.stderr
    assert "Traceback" not in proc.stderr
