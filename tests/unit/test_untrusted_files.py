"""Reading a file someone else may have placed (diloco/untrusted_files.py): a FIFO, a device, a link where none
belongs, an oversized file or deeply nested JSON or TOML is refused with the reason, at once."""

import os

import pytest

from diloco import untrusted_files
from diloco.untrusted_files import MAX_DEPTH, TooLarge, UntrustedFileError

pytestmark = pytest.mark.timeout(30)  # a FIFO that blocked the reader would hang here


def refused(call) -> str:
    with pytest.raises(UntrustedFileError) as e:
        call()
    return e.value.why


def test_a_fifo_a_device_and_a_folder_are_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "fifo")  # no writer: opening it for reading would wait forever
    assert refused(lambda: untrusted_files.read_bytes(tmp_path / "fifo", 10)) == "not a regular file (a FIFO)"
    (tmp_path / "zero").symlink_to("/dev/zero")
    for follow in (False, True):
        why = refused(lambda: untrusted_files.read_bytes(tmp_path / "zero", 1 << 30, follow_symlinks=follow))
        assert why == ("not a regular file (a device)" if follow else
                       "a symbolic link (refused: diloco never writes one here)")
    assert refused(lambda: untrusted_files.read_bytes(tmp_path, 10)) == "not a regular file (a folder)"


def test_a_link_is_followed_only_when_asked_and_only_to_a_regular_file(tmp_path):
    (tmp_path / "real").write_bytes(b"{}")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert untrusted_files.read_bytes(tmp_path / "link", 10, follow_symlinks=True) == b"{}"
    assert "symbolic link" in refused(lambda: untrusted_files.read_bytes(tmp_path / "link", 10))
    with pytest.raises(FileNotFoundError):  # absence is the caller's to judge
        untrusted_files.read_bytes(tmp_path / "none", 10)


def test_a_file_over_its_limit_is_refused(tmp_path):
    (tmp_path / "big").write_bytes(b"x" * 11)
    with pytest.raises(TooLarge, match="larger than 10 bytes"):
        untrusted_files.read_bytes(tmp_path / "big", 10)
    assert untrusted_files.read_bytes(tmp_path / "big", 11) == b"x" * 11
    with open(tmp_path / "big", "ab") as f:
        f.truncate(3 << 20)
    with pytest.raises(TooLarge, match="larger than 2 MB"):
        untrusted_files.read_bytes(tmp_path / "big", 2 << 20)


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 5000, 1_000_000])
def test_json_nested_too_deep_is_refused(tmp_path, depth):
    (tmp_path / "deep.json").write_text("[" * depth + "]" * depth)
    why = refused(lambda: untrusted_files.read_json(tmp_path / "deep.json", 4 << 20))
    assert why == f"nested deeper than {MAX_DEPTH} levels"
    nested = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert untrusted_files.parse_json(nested, "x") is not None
    assert refused(lambda: untrusted_files.parse_json('{"a": ', "x")).startswith("not valid JSON")


@pytest.mark.parametrize("text", ["a = " + "[" * 5000, "a = " + "[" * 100 + "]" * 100,
                                  "a." * 100 + "b = 1", "a = " + "{b = " * 100 + "1" + "}" * 100])
def test_toml_nested_too_deep_is_refused(tmp_path, text):
    (tmp_path / "deep.toml").write_text(text)
    assert refused(lambda: untrusted_files.read_toml(tmp_path / "deep.toml", 1 << 20)) == (
        f"nested deeper than {MAX_DEPTH} levels")


def test_toml_that_does_not_parse_says_so(tmp_path):
    (tmp_path / "bad.toml").write_bytes(b"x = \n")
    assert refused(lambda: untrusted_files.read_toml(tmp_path / "bad.toml", 100)).startswith("not valid TOML")
    (tmp_path / "bad.toml").write_bytes(b"x = '\xff'\n")
    assert refused(lambda: untrusted_files.read_toml(tmp_path / "bad.toml", 100)).startswith("not valid TOML")
