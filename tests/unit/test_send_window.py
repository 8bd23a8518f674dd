"""An update stream's send window (syncer/serving/send_window.py): at most a window beyond what the learner says it
received, nothing bounded for a learner that never says."""

import asyncio

from diloco.syncer.serving.send_window import SendWindow

MiB = 1 << 20


async def written_before_stall(window: SendWindow, chunks: int, size: int = 2 * MiB) -> int:
    """Chunks written before a write has to wait (all of them if none does)."""
    for n in range(chunks):
        try:
            await asyncio.wait_for(window.room_for(size), timeout=0.05)
        except asyncio.TimeoutError:
            return n
    return chunks


def test_a_learner_that_never_reports_is_not_bounded():
    assert asyncio.run(written_before_stall(SendWindow(8 * MiB), 20)) == 20


def test_a_reporting_learner_gets_a_window_beyond_what_it_received():
    async def main():
        window = SendWindow(8 * MiB)
        window.report(0)
        assert await written_before_stall(window, 20) == 4  # four 2 MiB chunks, then it waits
        waiting = asyncio.ensure_future(window.room_for(2 * MiB))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        window.report(2 * MiB)  # one chunk came in: one more may go
        await asyncio.wait_for(waiting, timeout=1)
        assert window.ahead == 8 * MiB
        window.report(MiB)  # a count that goes backwards is not taken
        assert window.received == 2 * MiB

    asyncio.run(main())


def test_a_chunk_larger_than_the_window_goes_once_nothing_is_ahead():
    async def main():
        window = SendWindow(MiB)
        window.report(0)
        await asyncio.wait_for(window.room_for(2 * MiB), timeout=1)
        assert await written_before_stall(window, 1) == 0

    asyncio.run(main())


def test_bytes_a_broken_stream_never_delivered_do_not_shrink_the_window():
    async def main():
        window = SendWindow(8 * MiB)
        window.report(0)
        assert await written_before_stall(window, 4) == 4
        window.report(2 * MiB)
        window.stream_ended()  # 6 MiB written were lost with it
        assert window.ahead == 0 and await written_before_stall(window, 20) == 4

    asyncio.run(main())


def test_no_window_is_no_bound():
    async def main():
        window = SendWindow(0)
        window.report(0)
        assert await written_before_stall(window, 20) == 20

    asyncio.run(main())
