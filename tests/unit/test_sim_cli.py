"""`diloco simulate ...` from the command line: output formats and clean errors."""

from __future__ import annotations

import argparse
import json

import pytest

from diloco.sim import simulate_command as sim_cli


def _write_report(directory) -> None:
    """A report.json as `diloco run` writes it (the fields --from-run reads)."""
    report = {
        "mode": "decoupled", "learners": 4, "wall_seconds": 120.0, "tokens_trained": 4_000_000,
        "wire_bytes": 2_000_000_000, "model_parameters": 10_000_000, "step_seconds_median": 0.25,
        "config": {"fragments": 4, "sync_every": 4, "overlap": 2, "codec": "int4"},
        "per_learner": [{"id": f"l{i}", "steps": 400, "tokens": 1_000_000} for i in range(4)],
    }
    directory.mkdir(parents=True)
    (directory / "report.json").write_text(json.dumps(report))


def _run(capsys, *argv) -> tuple[int, str, str]:
    """Parse and dispatch as the top-level `diloco` command does: args.func(args) returns the exit code."""
    parser = argparse.ArgumentParser(prog="diloco")
    sub = parser.add_subparsers(dest="command")
    sub.required = True
    sim_cli.register(sub)
    try:
        args = parser.parse_args(list(argv))
        code = args.func(args)
    except SystemExit as exc:  # argparse errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_goodput_json(capsys):
    code, out, _ = _run(capsys, "simulate", "goodput", "--chips", "150000,1.2M", "--learners", "8",
                        "--strategies", "dp,decoupled", "--days", "0.5", "--repeats", "2", "--seed", "3", "--json")
    assert code == 0
    rows = json.loads(out)
    assert [(r["strategy"], r["chips"], r["learners"]) for r in rows] == [
        ("dp", 150_000, 1), ("decoupled", 150_000, 8), ("dp", 1_200_000, 1), ("decoupled", 1_200_000, 8)]
    for r in rows:
        assert 0 <= r["goodput"] <= 1 and 0 <= r["uptime"] <= 1
    assert rows[0]["published_goodput"] == 0.72
    again = json.loads(_run(capsys, "simulate", "goodput", "--chips", "150000,1.2M", "--learners", "8",
                            "--strategies", "dp,decoupled", "--days", "0.5", "--repeats", "2", "--seed", "3",
                            "--json", "--jobs", "1")[1])
    assert again == rows


def test_goodput_table_and_plot(capsys, tmp_path):
    plot = tmp_path / "goodput.png"
    code, out, _ = _run(capsys, "simulate", "goodput", "--chips", "150k", "--learners", "8", "--days", "0.2",
                        "--repeats", "2", "--plot", str(plot))
    assert code == 0
    assert "dp-elastic" in out and "decoupled-8" in out and "diloco-8" in out
    assert plot.stat().st_size > 10_000


def test_goodput_overrides(capsys):
    code, out, _ = _run(capsys, "simulate", "goodput", "--chips", "150k", "--strategies", "dp-elastic",
                        "--days", "0.2", "--repeats", "1", "--set", "mtbi_seconds=1e30", "--json")
    assert code == 0 and json.loads(out)[0]["goodput"] == pytest.approx(1.0)


@pytest.mark.parametrize("argv, message", [
    (["--strategies", "dp,bogus"], "unknown strategy 'bogus'"),
    (["--chips", "-5"], "must be positive"),
    (["--chips", "lots"], "not a comma-separated list"),
    (["--preset", "gentle"], "invalid choice"),
    (["--set", "warp_factor=9"], "--set expects NAME=VALUE"),
    (["--set", "repair_seconds=-1"], "repair_seconds must not be negative"),
    (["--chips", "2000", "--learners", "16"], "smaller than one slice"),
    (["--quorum", "9", "--learners", "8"], "quorum 9 exceeds"),
])
def test_goodput_bad_flags(capsys, argv, message):
    code, out, err = _run(capsys, "simulate", "goodput", *argv)
    assert code == 2
    assert message in err and "Traceback" not in err


def test_bandwidth_json(capsys):
    code, out, _ = _run(capsys, "simulate", "bandwidth", "--json", "--target", "1")
    assert code == 0
    need = {r["method"]: r["required_gbps"]["1"] for r in json.loads(out)}
    assert need["dp"] == pytest.approx(198, rel=0.1) and need["decoupled"] == pytest.approx(0.84, rel=0.1)
    assert need["diloco"] is None  # blocking DiLoCo never reaches 100%


def test_bandwidth_table_and_bad_flags(capsys):
    code, out, _ = _run(capsys, "simulate", "bandwidth", "--params", "1B,10B", "--step-seconds", "0.2,1")
    assert code == 0 and "streaming" in out
    code, _, err = _run(capsys, "simulate", "bandwidth", "--methods", "dp,carrier-pigeon")
    assert code == 2 and "unknown method" in err
    code, _, err = _run(capsys, "simulate", "bandwidth", "--params", "1B,10B", "--step-seconds", "1,2,3")
    assert code == 2 and "--step-seconds" in err


def test_bandwidth_from_run(capsys, tmp_path):
    _write_report(tmp_path / "run")
    code, out, _ = _run(capsys, "simulate", "bandwidth", "--from-run", str(tmp_path / "run"), "--params", "5B",
                        "--learners", "8", "--gbps", "10", "--json")
    assert code == 0
    row = json.loads(out)
    assert row["mode"] == "decoupled" and row["projected"]["parameters"] == 5e9
    assert row["projected"]["learners"] == 8 and 0 < row["projected"]["utilisation"] <= 1
    code, out, _ = _run(capsys, "simulate", "bandwidth", "--from-run", str(tmp_path / "run"))
    assert code == 0 and "Projection" in out


@pytest.mark.parametrize("make", ["missing", "no-file", "no-field"])
def test_bandwidth_from_run_errors_are_one_line(capsys, tmp_path, make):
    run = tmp_path / "run"
    if make == "no-file":
        run.mkdir()
    elif make == "no-field":
        _write_report(run)
        report = json.loads((run / "report.json").read_text())
        del report["wire_bytes"]
        (run / "report.json").write_text(json.dumps(report))
    code, out, err = _run(capsys, "simulate", "bandwidth", "--from-run", str(run))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "error:" in err and "Traceback" not in err


def test_plot_to_a_missing_directory_is_a_clean_error(capsys, tmp_path):
    code, _, err = _run(capsys, "simulate", "bandwidth", "--plot", str(tmp_path / "no" / "such" / "dir.png"))
    assert code == 2 and "cannot write the plot" in err


def test_registered_in_the_top_level_command(capsys):
    from diloco.cli import main

    assert main(["simulate", "bandwidth", "--json", "--methods", "decoupled"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["method"] == "decoupled"
