"""The command line's shape: grouped --help, no abbreviations, short errors that name the flag, a fast --help."""

import argparse
import os
import socket
import subprocess
import sys

import pytest

from diloco import static
from diloco.cli import build_parser, main, train_config, with_config
from diloco.config_doc import field_docs
from diloco.run.compare import same_budget
from diloco.run.local import TINY


def parsers(parser: argparse.ArgumentParser, name: str = "diloco"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from parsers(sub, f"{name} {sub_name}")


def refused(capsys, *argv: str) -> list[str]:
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main(list(argv)))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()


def test_no_parser_takes_abbreviations():
    found = dict(parsers(build_parser()))
    assert {"diloco run", "diloco syncer", "diloco learner", "diloco compare", "diloco simulate"} <= set(found)
    assert [name for name, p in found.items() if p.allow_abbrev] == []


def test_an_abbreviated_flag_is_an_error_of_two_lines(capsys):
    lines = refused(capsys, "run", "--learner", "3")
    assert lines == ["diloco run: error: unrecognized arguments: --learner 3", "see `diloco run --help`"]


@pytest.mark.parametrize("argv, message", [
    (["run", "--mode", "sideways"], "diloco run: error: argument --mode: invalid choice: 'sideways'"),
    (["run", "--learners", "four"], "diloco run: error: argument --learners/-M: invalid int value: 'four'"),
    (["syncer", "--shard", "3/2"], "diloco syncer: error: argument --shard: shard 3/2: need 0 ≤ I < N"),
    (["learner", "--model", "huge"], "diloco learner: error: argument --model: invalid choice: 'huge'"),
])
def test_a_bad_value_is_the_error_and_a_pointer_to_help(capsys, argv, message):
    lines = refused(capsys, *argv)
    assert len(lines) == 2 and lines[0].startswith(message) and lines[1] == f"see `diloco {argv[0]} --help`"


def test_run_help_groups_its_flags():
    text = build_parser().commands["run"].format_help()
    titles = ["budget", "model and data", "learners and processes", "synchronisation", "our additions",
              "faults", "network", "output", "configuration file"]
    positions = [text.index(f"\n{t}") for t in titles]
    assert positions == sorted(positions)
    ours = text[text.index("\nour additions"):text.index("\nfaults")]
    assert "--keep-overlap" in ours and "--scale-partial-rounds" in ours and "--fragments" not in ours


def test_the_flags_of_our_additions_are_the_fields_marked_ours():
    assert static.ours() == {name for name, doc in field_docs(__import__("diloco.config").config.SyncConfig).items()
                             if doc.startswith("Ours")}


def test_constants_read_from_source_match_the_modules():
    import diloco
    from diloco import cli, config
    from diloco.algorithm import codec

    assert (cli.CODECS, cli.MODES, cli.PRESETS, cli.WIRE_COMPRESSIONS, cli.__version__) == (
        codec.CODECS, config.MODES, config.PRESETS, config.WIRE_COMPRESSIONS, diloco.__version__)


def test_help_and_a_bad_flag_do_not_import_torch():
    # the console script's path: the package's public API (torch, gRPC) is not imported to read the command line
    program = ("import sys\nfrom diloco_cli import main\nsys.argv = ['diloco'] + sys.argv[1:]\n"
               "try:\n    main()\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules, 'grpc' in sys.modules)")
    for argv in (["--help"], ["run", "--help"], ["syncer", "--help"], ["run", "--learner", "3"]):
        out = subprocess.run([sys.executable, "-c", program, *argv], capture_output=True, text=True, timeout=120)
        assert out.stdout.strip().splitlines()[-1] == "False False", (argv, out.stderr[-2000:])


def test_an_unwritable_out_names_the_flag(capsys, tmp_path):
    (tmp_path / "file").write_text("")
    target = tmp_path / "file" / "run"
    assert refused(capsys, "run", "--model", "tiny", "--steps", "1", "--out", str(target)) == [
        f"diloco run: error: --out: cannot write {target}: Not a directory"]
    assert refused(capsys, "run", "--model", "tiny", "--steps", "1", "--out", str(tmp_path / "ok"),
                   "--tensorboard", str(target)) == [
        f"diloco run: error: --tensorboard: cannot write {target}: Not a directory"]
    assert not (tmp_path / "ok").exists()  # refused before anything was written


def test_an_unwritable_syncer_state_names_the_flag(capsys, tmp_path):
    (tmp_path / "file").write_text("")
    target = tmp_path / "file" / "state"
    assert refused(capsys, "syncer", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--state", str(target)) == [
        f"diloco syncer: error: --state: cannot write {target}: Not a directory"]


def test_a_learner_of_the_built_in_model_needs_no_json():
    parser = build_parser()
    argv = ["learner", "--syncer", "127.0.0.1:1", "--id", "a", "--model", "tiny", "--batch-size", "4"]
    cfg = train_config(with_config(parser, parser.parse_args(argv), argv))
    assert cfg.model == TINY and cfg.batch_size == 4


def test_run_http_is_checked_before_anything_starts(capsys, tmp_path):
    assert "--http 0.0.0.0:8080: diloco run serves its dashboard on 127.0.0.1 only" in refused(
        capsys, "run", "--http", "0.0.0.0:8080", "--out", str(tmp_path / "a"))[0]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line, = refused(capsys, "run", "--model", "tiny", "--http", f"127.0.0.1:{port}", "--out", str(tmp_path / "b"))
    assert line.startswith(f"diloco run: error: --http 127.0.0.1:{port}: cannot listen there")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("corpus, message", [
    ("missing", "--corpus: corpus path {path} does not exist"),
    ("empty-dir", "--corpus: corpus directory {path} contains no non-empty *.txt or *.md files"),
    ("empty.txt", "--corpus: corpus file {path} is empty"),
    ("short.txt", "--corpus: 38 training tokens are too few for 4 shards of 64-token sequences"),
])
def test_a_bad_corpus_is_refused_before_any_process_starts(capsys, tmp_path, corpus, message):
    (tmp_path / "empty-dir").mkdir()
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "short.txt").write_text("a few words, far fewer than one sequence")
    path = tmp_path / corpus
    line, = refused(capsys, "run", "--model", "tiny", "--corpus", str(path), "--out", str(tmp_path / "run"))
    assert line.startswith("diloco run: error: " + message.format(path=path))
    assert not (tmp_path / "run").exists()


def test_compare_gives_every_mode_the_same_tokens():
    # 150,000 tokens, 4 learners of 1,024-token steps: dp used to train 37 whole steps (151,552 tokens) while
    # decoupled learners, told of the end by heartbeats, trained 42 (172,032); now every mode runs 37 steps
    flags, line = same_budget(argparse.Namespace(duration=None, tokens=150_000, learners=4), 1024)
    assert flags == ["--steps", "37"]
    assert line == ("same budget: 37 steps × 4 learners × 1,024 tokens = 151,552 tokens per mode "
                    "(--tokens 150,000 rounded up to whole steps)")
    flags, line = same_budget(argparse.Namespace(duration=None, tokens=8192, learners=4), 1024)
    assert flags == ["--steps", "2"] and line.endswith("= 8,192 tokens per mode")
    flags, line = same_budget(argparse.Namespace(duration=30.0, tokens=None, learners=4), 1024)
    assert flags == ["--duration", "30.0"] and "tokens differ" in line


def test_compare_refuses_tokens_with_chaos(capsys):
    assert "--tokens with --chaos" in refused(capsys, "compare", "--tokens", "1000", "--chaos", "kill-one")[0]


def test_package_exports_and_typing_marker():
    import importlib.resources
    import tomllib
    from pathlib import Path

    import diloco

    for name in diloco.__all__:
        assert getattr(diloco, name) is not None, name
    assert "Learner" in vars(diloco)  # bound at import, where editors and type checkers look
    assert importlib.resources.files("diloco").joinpath("py.typed").is_file()
    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["diloco"]
    assert project["project"]["scripts"]["diloco"] == "diloco_cli:main"
    assert os.path.exists(Path(__file__).resolve().parents[2] / "LICENSE")


@pytest.mark.parametrize("flag, value, message", [
    ("--batch-size", "0", "--batch-size must be at least 1, got 0"),
    ("--lr", "-1", "--lr must be a positive number, got -1.0"),
    ("--seed", "-2", "--seed must be 0 or more, got -2"),
])
def test_training_settings_that_cannot_train_are_refused_before_anything_starts(capsys, tmp_path, flag, value, message):
    assert refused(capsys, "run", "--model", "tiny", flag, value, "--out", str(tmp_path / "run")) == [
        f"diloco run: error: {message}"]
    assert not (tmp_path / "run").exists()
