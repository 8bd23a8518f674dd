"""Secrets off the command line: --token-file, --status-token-file and $DILOCO_TOKEN / $DILOCO_STATUS_TOKEN."""

import logging
import os

import pytest

from diloco import cli, secret_sources
from diloco.options import UserError


def parsed(argv, environ=None, monkeypatch=None):
    for name in ("DILOCO_TOKEN", "DILOCO_STATUS_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (environ or {}).items():
        monkeypatch.setenv(name, value)
    parser = cli.build_parser()
    return cli.with_config(parser, parser.parse_args(argv), argv)


def secret_file(tmp_path, text, mode=0o600, name="token"):
    path = tmp_path / name
    path.write_text(text)
    path.chmod(mode)
    return path


def test_a_token_file_gives_the_secret_without_its_newline(tmp_path, monkeypatch):
    path = secret_file(tmp_path, "s3cret\n")
    args = parsed(["syncer", "--token-file", str(path), "--status-token-file", str(path)], monkeypatch=monkeypatch)
    assert args.token == "s3cret" and args.status_token == "s3cret"
    args = parsed(["learner", "--syncer", "h:1", "--id", "a", "--token-file", str(path)], monkeypatch=monkeypatch)
    assert args.token == "s3cret"


def test_the_environment_is_the_fallback_and_the_command_line_wins(monkeypatch):
    env = {"DILOCO_TOKEN": "from-env", "DILOCO_STATUS_TOKEN": "look"}
    args = parsed(["syncer"], env, monkeypatch)
    assert (args.token, args.status_token) == ("from-env", "look")
    assert parsed(["syncer", "--token", "typed"], env, monkeypatch).token == "typed"
    assert parsed(["syncer"], {}, monkeypatch).token is None
    # `diloco status` reads a status token first, the run's token else
    assert parsed(["status", "127.0.0.1:8080"], env, monkeypatch).token == "look"
    assert parsed(["status", "127.0.0.1:8080"], {"DILOCO_TOKEN": "run"}, monkeypatch).token == "run"


def test_a_flag_and_its_file_together_are_refused(tmp_path, monkeypatch):
    path = secret_file(tmp_path, "s3cret")
    with pytest.raises(UserError, match="--token and --token-file both give the secret"):
        parsed(["syncer", "--token", "x", "--token-file", str(path)], monkeypatch=monkeypatch)


@pytest.mark.parametrize("text, why", [("", "it is empty"), ("two words\n", "whitespace inside"),
                                       ("x" * 5000, "larger than 4096 bytes")])
def test_a_file_that_is_not_one_secret_is_refused(tmp_path, monkeypatch, text, why):
    with pytest.raises(UserError, match=why):
        parsed(["syncer", "--token-file", str(secret_file(tmp_path, text))], monkeypatch=monkeypatch)


def test_a_fifo_or_a_missing_file_is_refused_at_once(tmp_path, monkeypatch):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(UserError, match="not a regular file"):  # never blocks waiting for a writer
        parsed(["syncer", "--token-file", str(fifo)], monkeypatch=monkeypatch)
    with pytest.raises(UserError, match="cannot read the secret"):
        parsed(["syncer", "--token-file", str(tmp_path / "absent")], monkeypatch=monkeypatch)


def test_a_file_others_can_read_is_used_with_a_warning(tmp_path, monkeypatch, caplog):
    path = secret_file(tmp_path, "s3cret", mode=0o644)
    with caplog.at_level(logging.WARNING, logger="diloco.secrets"):
        assert parsed(["syncer", "--token-file", str(path)], monkeypatch=monkeypatch).token == "s3cret"
    assert f"chmod 600 {path}" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="diloco.secrets"):
        parsed(["syncer", "--token-file", str(secret_file(tmp_path, "s3cret", name="private"))],
               monkeypatch=monkeypatch)
    assert "chmod" not in caplog.text


def test_the_command_says_what_was_wrong_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("DILOCO_TOKEN", raising=False)
    assert cli.main(["syncer", "--token-file", str(secret_file(tmp_path, ""))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "diloco syncer: error: --token-file" in err[0] and "it is empty" in err[0]


def test_every_secret_flag_has_a_file_and_a_variable():
    parser = cli.build_parser()
    for command in ("syncer", "learner", "status"):
        flags = {o for a in parser.commands[command]._actions for o in a.option_strings}
        assert "--token-file" in flags, command
    assert set(secret_sources.SOURCES) == {"token", "status_token"}


def test_a_printed_config_never_holds_a_secret_and_a_file_holding_one_is_warned_of(tmp_path, monkeypatch, capsys,
                                                                                  caplog):
    monkeypatch.setenv("DILOCO_TOKEN", "from-env")
    assert cli.main(["syncer", "--status-token", "look", "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert "from-env" not in printed and "look" not in printed
    assert "# token = (given; not printed: use token_file or $DILOCO_TOKEN)" in printed
    config = tmp_path / "syncer.toml"
    config.write_text('token = "typed"\n')
    with caplog.at_level(logging.WARNING, logger="diloco.config"):
        assert parsed(["syncer", "--config", str(config)], monkeypatch=monkeypatch).token == "typed"
    assert "holds the secret 'token'" in caplog.text and "token_file" in caplog.text
