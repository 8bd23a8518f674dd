"""`--config FILE.toml` and `--print-config` for run, syncer, learner and compare."""

import argparse
from dataclasses import fields
from pathlib import Path

import pytest

from diloco import config_file
from diloco.cli import build_parser, main, resolved_sync_config, train_config, with_config
from diloco.config import SyncConfig
from diloco.run.local import TINY

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "config"


def parse(*argv: str) -> argparse.Namespace:
    parser = build_parser()
    return with_config(parser, parser.parse_args(list(argv)), list(argv))


def printed(capsys, *argv: str) -> str:
    assert main([*argv, "--print-config"]) == 0
    return capsys.readouterr().out


def refused(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def write(tmp_path, text: str, name: str = "c.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_file_settings_reach_the_run_and_the_command_line_overrides_them(tmp_path):
    f = write(tmp_path, 'learners = 2\nsteps = 7\n[sync]\nmode = "streaming"\nfragments = 4\ngrace_gamma = 0.25\n'
                        '[train]\nmodel = "tiny"\nbatch_size = 8\nwarmup_steps = 5\n')
    args = parse("run", "--config", f, "--fragments", "2", "--learners", "3")
    assert (args.learners, args.steps, args.mode) == (3, 7, "streaming")
    sync = resolved_sync_config(args)
    assert (sync.fragments, sync.grace_gamma, sync.quorum) == (2, 0.25, 3)  # K = all learners, from the mode
    train = train_config(args)
    assert (train.model, train.batch_size, train.warmup_steps) == (TINY, 8, 5)


def test_model_options_reach_the_model_whatever_its_size():
    train = train_config(parse("run", "--model", "tiny", "--qk-norm", "--z-loss", "1e-4", "--warmup-steps", "60"))
    assert (train.model.d_model, train.model.qk_norm, train.model.z_loss, train.warmup_steps) == (64, True, 1e-4, 60)
    assert (train_config(parse("run")).model.qk_norm, train_config(parse("run")).model.z_loss) == (False, 0.0)


def test_a_flag_given_equal_to_its_default_still_beats_the_file(tmp_path):
    f = write(tmp_path, "learners = 8\n")
    assert parse("run", "--config", f, "--learners", "4").learners == 4


@pytest.mark.parametrize("command, argv", [
    ("run", ["--learners", "2", "--steps", "10", "--mode", "diloco", "--outer-lr", "0.5", "--model", "tiny",
             "--corpus", "a.txt", "b", "--http", "127.0.0.1:8123", "--no-keep-overlap"]),
    ("run", ["--mode", "dp", "--duration", "30", "--out", "r", "--lr-decay", "0"]),
    ("run", ["--model", "tiny", "--warmup-steps", "60", "--qk-norm", "--z-loss", "1e-4"]),
    ("syncer", ["--listen", "127.0.0.1:6000", "--shard", "1/2", "--state", "s", "--duration", "3",
                "--fragments", "4", "--preset", "paper"]),
    ("learner", ["--syncer", "127.0.0.1:1,127.0.0.1:2", "--id", "x", "--pace", "0.5", "--model", "tiny",
                 "--tls", "--seed", "3"]),
    ("compare", ["--modes", "decoupled,dp", "--tokens", "150000", "--model", "tiny", "--link-latency-ms", "40"]),
])
def test_print_config_round_trips(capsys, tmp_path, command, argv):
    first = printed(capsys, command, *argv)
    f = write(tmp_path, first)
    second = printed(capsys, command, "--config", f)
    assert second == first
    original, loaded = parse(command, *argv), parse(command, "--config", f)
    effective = config_file.effective
    parser = build_parser().commands[command]
    assert (effective(command, parser, loaded, loaded.parser_defaults)
            == effective(command, parser, original, original.parser_defaults))
    if command in ("run", "syncer") and original.mode != "dp":
        assert resolved_sync_config(loaded) == resolved_sync_config(original)
    if command in ("run", "learner"):
        assert train_config(loaded) == train_config(original)


def test_every_syncconfig_field_is_a_sync_key(tmp_path):
    # read from the dataclass: a field added to SyncConfig is a [sync] key with no change to the loader
    body = "".join(f"{f.name} = {config_file.toml_value(getattr(SyncConfig(), f.name))}\n"
                   for f in fields(SyncConfig) if getattr(SyncConfig(), f.name) is not None)
    args = parse("syncer", "--config", write(tmp_path, "[sync]\n" + body.replace('mode = "decoupled"', "")))
    for f in fields(SyncConfig):
        if f.name != "mode" and getattr(SyncConfig(), f.name) is not None:
            assert f.name in args.sync_fields or getattr(args, f.name, None) is not None, f.name


@pytest.mark.parametrize("text, message", [
    ("learner = 3\n", "unknown key learner for diloco run; did you mean learners?"),
    ("[sync]\nfragmets = 3\n", "unknown key [sync] fragmets for diloco run; did you mean [sync] fragments?"),
    ("fragments = 3\n", "unknown key fragments for diloco run; did you mean [sync] fragments?"),
    ("[model]\nd_model = 3\n", "unknown table [model] for diloco run (it takes [sync] and [train])"),
    ('learners = "four"\n', "learners must be an integer, got a string ('four')"),
    ("[sync]\ngrace_gamma = \"x\"\n", "[sync] grace_gamma must be a number, got a string ('x')"),
    ("[sync]\nkeep_overlap = 1\n", "[sync] keep_overlap must be true or false, got an integer (1)"),
    ("[train]\nbetas = [0.9]\n", "[train] betas must be a list of 2 values"),
    ("[train]\ncorpus = \"a.txt\"\n", "[train] corpus must be a list of strings"),
    ("[sync]\nmode = \"sideways\"\n", "[sync] mode: invalid choice 'sideways'"),
    ('http = "nohost"\n', "http: expected HOST:PORT, got 'nohost'"),
    ("x = \n", "not valid TOML"),
])
def test_bad_files_are_refused_by_key(capsys, tmp_path, text, message):
    err = refused(capsys, "run", "--config", write(tmp_path, text))
    assert message in err


def test_tables_a_command_does_not_take_are_refused(capsys, tmp_path):
    assert "unknown table [sync] for diloco learner (it takes [train])" in refused(
        capsys, "learner", "--config", write(tmp_path, "[sync]\nfragments = 2\n"))
    assert "unknown table [train] for diloco compare (it takes no tables)" in refused(
        capsys, "compare", "--config", write(tmp_path, "[train]\nseed = 2\n"))


def test_a_missing_file_and_missing_required_flags_are_one_line(capsys, tmp_path):
    assert "--config /nonexistent.toml: cannot read it: No such file or directory" in refused(
        capsys, "run", "--config", "/nonexistent.toml")
    assert "--id is required (on the command line, or in a --config file)" in refused(
        capsys, "learner", "--config", write(tmp_path, 'syncer = "127.0.0.1:1"\n'))


@pytest.mark.parametrize("example, command", [("run", "run"), ("syncer", "syncer"), ("learner", "learner"),
                                               ("island", "learner")])
def test_examples_load_and_round_trip(capsys, tmp_path, example, command):
    first = printed(capsys, command, "--config", str(EXAMPLES / f"{example}.toml"))
    assert printed(capsys, command, "--config", write(tmp_path, first)) == first
