"""Flow control: frames cut to the payload limit (the worker's part); acks batched per instance and frames
joined for a reader that lags (the client's part)."""

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any

import nats.errors
from msgspec import Raw
from nats.aio.client import Client as NATS

from runtime.request_plane.loop_bound import SingleReaderQueue
from runtime.request_plane.wire import DATA, END, Acks, Frame, encode

# Bytes of a DATA or END frame beyond its payloads' (its array and list headers, kind, seq, the empty
# error and code), rounded up.
FRAME_OVERHEAD = 64


def fitting(payloads: list[Raw], limit: int) -> tuple[int, int]:
    """How many of ``payloads``, from the first, fit in ``limit`` bytes together, and their size.

    At least one: a payload alone over the limit goes alone (and NATS refuses it).
    """
    size = 0
    for count, payload in enumerate(payloads):
        length = len(payload)
        if count and size + length > limit:
            return count, size
        size += length
    return len(payloads), size


def batches(payloads: list[Raw], limit: int) -> list[list[Raw]]:
    """``payloads`` cut, in order, into batches of at most ``limit`` bytes each (one batch if none)."""
    cut: list[list[Raw]] = []
    while True:
        count, _ = fitting(payloads, limit)
        cut.append(payloads[:count])
        payloads = payloads[count:]
        if not payloads:
            return cut


class AckBatcher:
    """A client's acks, sent per instance as one ``Acks`` message per tick of ``interval`` s."""

    def __init__(self, nc: NATS, interval: float, spawn: Callable[[Coroutine[Any, Any, None]], None]) -> None:
        self._nc = nc
        self._interval = interval
        self._spawn = spawn
        # Acks not yet sent, by control subject (request id -> last DATA frame taken).
        self._acks: dict[str, dict[str, int]] = {}
        self._flush: asyncio.TimerHandle | None = None

    def add(self, control: str, request_id: str, seq: int) -> None:
        """Queue an ack; the acks of one tick go out as one message per instance."""
        pending = self._acks.get(control)
        if pending is None:
            pending = self._acks[control] = {}
        pending[request_id] = seq
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(self._interval, self._flush_acks)

    def close(self) -> None:
        if self._flush is not None:
            self._flush.cancel()

    def _flush_acks(self) -> None:
        self._flush = None
        acks, self._acks = self._acks, {}
        self._spawn(self._send(acks))

    async def _send(self, acks: dict[str, dict[str, int]]) -> None:
        for control, streams in acks.items():
            with contextlib.suppress(nats.errors.Error):
                await self._nc.publish(control, encode(Acks(list(streams.items()))))


def take_following(queue: SingleReaderQueue[Frame | None], payloads: list[Raw], expected: int) -> tuple[int, int]:
    """Move onto ``payloads`` the payloads of the DATA frames next in sequence at the head of ``queue``, and
    of an END frame after them.

    Returns the sequence number expected next and the kind of the last frame taken (DATA or END).
    Anything else at the head (a heartbeat, an error, a frame out of sequence) stays for the caller.
    """
    kind = DATA
    while queue.qsize():
        frame = queue.first()
        if frame is None or frame.seq != expected or frame.kind not in (DATA, END):
            break
        queue.get_nowait()
        payloads += frame.payloads
        expected += 1
        kind = frame.kind
        if kind == END:
            break
    return expected, kind
