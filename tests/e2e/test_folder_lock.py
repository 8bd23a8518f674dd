"""One syncer per state folder (syncer/at_rest/folder_lock.py): a second syncer on a live folder is refused naming the
first's pid and address, exits 75 and touches nothing; once the first is gone, however it went (SIGKILL
included), the folder is free."""

import json
import os
import signal
import subprocess
import sys

import pytest

from diloco import exits
from diloco.config import for_mode
from diloco.syncer.at_rest.folder_lock import LOCK_FILE, FolderInUse, FolderLock
from diloco.syncer.serving.server import ServerOptions, SyncerThread
from liveness import wait_for
from syncers import trained_learner

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def started():
    """Every process the test starts, killed at its end whatever happened."""
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def syncer_argv(state, listen="127.0.0.1:0") -> list[str]:
    return [sys.executable, "-m", "diloco", "syncer", "--listen", listen, "--http", "127.0.0.1:0", "--state",
            str(state), "--learners", "1", "--fragments", "2", "--sync-every", "4"]


def start_syncer(state, started) -> tuple[subprocess.Popen, dict]:
    """A syncer process serving on `state`, once it wrote its ready.json."""
    proc = subprocess.Popen(syncer_argv(state), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started.append(proc)

    def ready() -> bool:
        assert proc.poll() is None, "the syncer ended before serving"
        try:
            return json.loads((state / "ready.json").read_text())["pid"] == proc.pid
        except (OSError, ValueError, KeyError):
            return False

    wait_for(ready, timeout=120)
    return proc, json.loads((state / "ready.json").read_text())


def contents(folder) -> dict:
    """Every file's bytes and modification time, but the history (its save is on a 30 s clock of its own)."""
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != "history.json"}


def settled(folder) -> dict:
    """`contents(folder)` once two looks in a row agree (the first syncer done with what a learner sent)."""
    seen: dict = {}

    def same() -> bool:
        now = contents(folder)
        agree, seen["last"] = now == seen.get("last"), now
        return agree

    wait_for(same, timeout=60, period=0.5)
    return seen["last"]


def second_syncer(state) -> subprocess.CompletedProcess:
    return subprocess.run(syncer_argv(state), capture_output=True, text=True, timeout=120)


def test_a_second_syncer_on_a_live_folder_is_refused_and_the_folder_is_free_once_the_first_is_gone(tmp_path, started):
    state = tmp_path / "syncer"
    first, ready = start_syncer(state, started)
    trained_learner(f"127.0.0.1:{ready['grpc_port']}", "a", steps=8).close()  # a state worth protecting
    wait_for(lambda: (state / "state" / "manifest.json").exists(), timeout=60)
    before = settled(state)

    refused = second_syncer(state)
    assert refused.returncode == exits.RETRY == 75
    assert "Traceback" not in refused.stderr
    assert (f"the state folder {state} is in use by another syncer (pid {first.pid}, gRPC address "
            f"127.0.0.1:{ready['grpc_port']})") in refused.stderr
    assert contents(state) == before  # nothing read and rewritten, nothing created
    assert first.poll() is None  # the first serves on

    first.send_signal(signal.SIGTERM)  # a clean stop frees the folder
    assert first.wait(60) == 0
    second, _ = start_syncer(state, started)
    second.kill()  # SIGKILL: the kernel drops the lock with the process
    second.wait(30)
    third, _ = start_syncer(state, started)
    third.send_signal(signal.SIGTERM)
    assert third.wait(60) == 0


def test_a_second_syncer_thread_on_a_live_folder_is_refused(tmp_path):
    cfg = for_mode("decoupled", 1, fragments=2, sync_every=4)
    options = ServerOptions(listen="127.0.0.1:0", http=None, out=tmp_path / "syncer")
    first = SyncerThread(cfg, options)
    try:
        with pytest.raises(RuntimeError, match=rf"in use by another syncer \(pid {os.getpid()}, gRPC address "
                                               rf"127\.0\.0\.1:{first.status['grpc_port']}\)"):
            SyncerThread(cfg, options)
    finally:
        first.stop()
    SyncerThread(cfg, options).stop()  # stopped: the folder is free


def test_the_lock_file_names_its_holder_and_refuses_what_it_did_not_make(tmp_path):
    lock = FolderLock(tmp_path, "127.0.0.1:0")
    lock.describe("127.0.0.1:5")
    assert json.loads((tmp_path / LOCK_FILE).read_text()) == {"pid": os.getpid(), "address": "127.0.0.1:5"}
    with pytest.raises(FolderInUse, match=rf"pid {os.getpid()}, gRPC address 127\.0\.0\.1:5\)"):
        FolderLock(tmp_path, "127.0.0.1:0")
    (tmp_path / LOCK_FILE).write_text("garbage")  # being written, or not ours: the lock itself still holds
    with pytest.raises(FolderInUse, match="its pid and address are not written yet"):
        FolderLock(tmp_path, "127.0.0.1:0")
    lock.release()
    FolderLock(tmp_path, "127.0.0.1:0").release()

    (tmp_path / LOCK_FILE).unlink()
    os.mkfifo(tmp_path / LOCK_FILE)  # opened without blocking, then refused
    with pytest.raises(OSError, match="is not a regular file"):
        FolderLock(tmp_path, "127.0.0.1:0")
    (tmp_path / LOCK_FILE).unlink()
    (tmp_path / LOCK_FILE).symlink_to("/dev/zero")
    with pytest.raises(OSError, match="is a symbolic link"):
        FolderLock(tmp_path, "127.0.0.1:0")
