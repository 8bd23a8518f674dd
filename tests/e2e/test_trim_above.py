"""`--trim-above`: the serving loop gives malloc's free memory back to the system when it keeps more than the bound,
and never with the default 0."""

from diloco import ServerOptions, SyncerThread, allocator, for_mode
from liveness import wait_for


def trims_while_serving(monkeypatch, trim_above: int) -> int:
    """Calls of `allocator.trim` by a syncer serving with `trim_above` until it has run a second and more (the loop
    looks at once, then every TRIM_SECONDS)."""
    calls = []
    monkeypatch.setattr(allocator, "trim", lambda: calls.append(1) or True)
    syncer = SyncerThread(for_mode("decoupled", 1), ServerOptions(listen="127.0.0.1:0", http=None,
                                                                  trim_above=trim_above))
    try:
        wait_for(lambda: syncer.status.get("memory", {}).get("allocator_free", 0) > 1, timeout=30)
        wait_for(lambda: syncer.status.get("uptime_seconds", 0) > 1.0 and (calls or not trim_above), timeout=30)
    finally:
        syncer.stop()
    return len(calls)


def test_the_serving_loop_trims_when_malloc_keeps_more_than_the_bound(monkeypatch):
    assert trims_while_serving(monkeypatch, trim_above=1) >= 1


def test_nothing_is_trimmed_by_default(monkeypatch):
    assert trims_while_serving(monkeypatch, trim_above=0) == 0
