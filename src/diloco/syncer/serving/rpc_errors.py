"""No bad input ends an RPC as UNKNOWN: a handler's exceptions from what a client sent become INVALID_ARGUMENT
naming it, and no status message is longer than gRPC's trailers can carry."""

from __future__ import annotations

import functools
import inspect

import grpc

from diloco.algorithm import codec

BAD_INPUT = (ValueError, KeyError, IndexError, OverflowError, TypeError, codec.CorruptPayload)
"""What bad input makes the code below raise; each becomes INVALID_ARGUMENT naming it, never UNKNOWN."""
MAX_DETAILS = 1000
"""Characters of an error's text in a status: gRPC refuses trailers over 16 KB (the client would see that instead)."""


class ShuttingDown(Exception):
    """The syncer's workers have stopped: the RPC ends UNAVAILABLE, which learners retry (against a restart)."""


async def _unavailable(context) -> None:
    await context.abort(grpc.StatusCode.UNAVAILABLE, "the syncer is shutting down; retry against its replacement")


def short(details: str) -> str:
    return details if len(details) <= MAX_DETAILS else details[:MAX_DETAILS] + f"… ({len(details)} characters)"


class _Context:
    """The RPC's context, with every abort's message cut to MAX_DETAILS (it may quote what the client sent)."""

    def __init__(self, context):
        self._context = context
        self.aborted: tuple[grpc.StatusCode, str] | None = None
        """The code and message the RPC was ended with, once `abort` was called."""

    def __getattr__(self, name):
        return getattr(self._context, name)

    async def abort(self, code, details: str = "", trailing_metadata=()):
        self.aborted = (code, short(details))
        await self._context.abort(code, short(details), trailing_metadata)


def guarded(method):
    """An RPC handler whose unexpected exceptions from bad input become INVALID_ARGUMENT with their message, and
    whose status messages are never longer than MAX_DETAILS."""
    rpc = method.__name__

    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def stream(self, request, context):
            context = _Context(context)
            replies = method(self, request, context)
            try:
                try:
                    async for reply in replies:
                        yield reply
                except BAD_INPUT as e:
                    await self._bad_input(context, rpc, e)
                except ShuttingDown:
                    await _unavailable(context)
            finally:
                await replies.aclose()  # runs the handler's own clean-up now (its open-stream count)
        return stream

    @functools.wraps(method)
    async def unary(self, request, context):
        context = _Context(context)
        try:
            return await method(self, request, context)
        except BAD_INPUT as e:
            await self._bad_input(context, rpc, e)
        except ShuttingDown:
            await _unavailable(context)
    return unary
