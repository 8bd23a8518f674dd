"""Every benchmark that writes a results file writes beside its numbers the commit, the command and its full
settings, the machine and the time (benchmarks/provenance.py)."""

import argparse
import re
from pathlib import Path

from benchmarks import ROOT
from benchmarks.provenance import provenance, stamped

BENCHMARKS = ROOT / "benchmarks"

NOT_RESULTS = {"corpus.py"}
"""Writes a data set's manifest, not figures."""


def test_a_results_file_carries_commit_command_settings_and_machine():
    args = argparse.Namespace(seeds="0,1", steps=300, out=Path("runs/x"))
    record = stamped({"runs": {}}, args)["provenance"]
    assert re.fullmatch(r"[0-9a-f]{40}(\+changes)?|unknown", record["commit"])
    assert record["settings"] == {"seeds": "0,1", "steps": 300, "out": "runs/x"}
    assert record["machine"]["cores"] >= 1 and record["machine"]["cpu"] and record["machine"]["torch"]
    assert record["command"] and record["written"].endswith("+00:00")


def test_a_resumed_file_keeps_its_first_record_and_adds_other_invocations():
    args = argparse.Namespace(seeds="0")
    first = stamped({"runs": {}}, args)
    assert stamped(first, args) == first  # the same commit and command: nothing added
    other = {**provenance(args), "command": "python -m benchmarks.hostile.byzantine --seeds 1"}
    first["provenance_more"] = [other]
    again = stamped(first, args)
    assert again["provenance"] == first["provenance"] and again["provenance_more"] == [other]


def test_every_benchmark_that_writes_results_stamps_them():
    writers = [p for p in BENCHMARKS.glob("*/*.py")
               if re.search(r"write_text\(json\.dumps|json\.dump\(", p.read_text()) and p.name not in NOT_RESULTS]
    assert len(writers) >= 15
    unstamped = [p.name for p in writers if "stamped(" not in p.read_text() and "commit()" not in p.read_text()]
    assert not unstamped, f"results written without their provenance: {unstamped}"
