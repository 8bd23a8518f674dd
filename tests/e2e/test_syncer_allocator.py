"""`--allocator jemalloc`: the syncer starts itself again with jemalloc preloaded, under the same pid, and says so on
/status; by default it keeps glibc's malloc; asked for jemalloc where it cannot have it, it stops with what to install
or do."""

import ctypes.util
import json
import subprocess
import sys
import urllib.request

import pytest

from diloco import cli
from liveness import wait_for

pytestmark = pytest.mark.timeout(240)

JEMALLOC_MISSING = None if ctypes.util.find_library("jemalloc") else (
    "jemalloc is not installed: apt-get install libjemalloc2")


def serve(state, *flags) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([sys.executable, "-m", "diloco", "syncer", "--listen", "127.0.0.1:0", "--http",
                             "127.0.0.1:0", "--state", str(state), "--learners", "1", *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def ready() -> bool:
        assert proc.poll() is None, f"the syncer ended before serving: {proc.stderr.read()[-2000:]}"
        return (state / "ready.json").exists()

    try:
        wait_for(ready, timeout=120)
        return proc, json.loads((state / "ready.json").read_text())
    except BaseException:
        proc.kill()
        proc.wait()
        raise


def loaded_libraries(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as maps:
        return maps.read()


@pytest.mark.needs(JEMALLOC_MISSING)
@pytest.mark.parametrize("flags, allocator", [(("--allocator", "jemalloc"), "jemalloc"), ((), "glibc")])
def test_the_syncer_runs_on_jemalloc_when_told_and_on_glibc_otherwise(tmp_path, flags, allocator):
    proc, ready = serve(tmp_path / "state", *flags)
    try:
        assert ready["pid"] == proc.pid  # started again in place: whoever started it still holds its process
        assert ("libjemalloc" in loaded_libraries(proc.pid)) == (allocator == "jemalloc")
        with urllib.request.urlopen(f"http://127.0.0.1:{ready['http_port']}/status", timeout=30) as reply:
            status = json.loads(reply.read())
        assert status["allocator"] == allocator
        assert status["memory"]["other_heap"] > 0  # what the allocator has handed out is counted on either
    finally:
        proc.kill()
        proc.wait()


def test_jemalloc_asked_for_and_not_installed_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("diloco.allocator.find_jemalloc", lambda: None)
    code = cli.main(["syncer", "--allocator", "jemalloc", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0",
                     "--state", str(tmp_path / "state")])
    assert code != 0
    err = capsys.readouterr().err
    assert "--allocator jemalloc: jemalloc is not installed (apt-get install libjemalloc2" in err
    assert "or leave out --allocator" in err
    assert not (tmp_path / "state" / "ready.json").exists()


def test_jemalloc_asked_for_in_a_process_that_started_without_it_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("diloco.allocator.find_jemalloc", lambda: "libjemalloc.so.2")
    monkeypatch.setattr("diloco.allocator.name", lambda: "glibc")
    code = cli.main(["syncer", "--allocator", "jemalloc", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0",
                     "--state", str(tmp_path / "state")])
    assert code != 0
    assert "a syncer started inside another program runs on the allocator" in capsys.readouterr().err
