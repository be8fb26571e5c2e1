"""Sleeping until a deadline with sub-millisecond precision, inside an asyncio event loop.

``asyncio.sleep`` is only as fine as the loop's timers: uvloop (libuv) keeps them in whole
milliseconds, and the standard loop hands ``epoll_wait`` a timeout in milliseconds too, so a sleep
ends up to a millisecond late (or, with a stale loop clock, early). That is noise for most waits, but
not for the mocker engine, whose every step *is* a timed wait: a token simulated to be ready at
t = 6.21 ms would reach its client at 7 ms, and a whole benchmark's latencies shift by half a
millisecond on average.

A Linux timerfd armed with an absolute ``CLOCK_MONOTONIC`` deadline (the clock of
``time.monotonic()``) becomes readable when the kernel's high-resolution timer fires, and the event
loop wakes for a readable file at once, so the wait ends within tens of microseconds of the deadline
without spinning. The project runs on Python 3.11, which has no ``os.timerfd_create`` (3.13 adds it),
so the two libc calls are made through ctypes. Elsewhere than Linux ``PreciseSleeper`` falls back to
``asyncio.sleep``.
"""

import asyncio
import ctypes
import math
import os
import sys
import time

_CLOCK_MONOTONIC = 1
_TFD_NONBLOCK = os.O_NONBLOCK
_TFD_CLOEXEC = os.O_CLOEXEC
_TFD_TIMER_ABSTIME = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _load_libc() -> ctypes.CDLL | None:
    if sys.platform != "linux":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # the process's own symbols, libc's among them
        libc.timerfd_create.argtypes = (ctypes.c_int, ctypes.c_int)
        libc.timerfd_settime.argtypes = (
            ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Itimerspec), ctypes.POINTER(_Itimerspec)
        )  # fmt: skip
    except (OSError, AttributeError):
        return None
    return libc


_libc = _load_libc()


class PreciseSleeper:
    """Sleeps of one task at a time until ``time.monotonic()`` deadlines, on the running loop.

    One per sleeping task (the mocker has one per dp rank): it owns a timerfd registered with the loop
    once, re-armed for every sleep. ``close()`` releases the descriptor.
    """

    def __init__(self) -> None:
        self._fd: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._spec = _Itimerspec()
        if _libc is not None:
            fd = _libc.timerfd_create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
            self._fd = fd if fd >= 0 else None

    @property
    def precise(self) -> bool:
        """Whether sleeps use a timerfd (False: ``asyncio.sleep``'s millisecond timers)."""
        return self._fd is not None

    async def sleep_until(self, deadline: float) -> None:
        """Return once ``time.monotonic()`` reaches ``deadline`` (at once if it has).

        Raises RuntimeError if another task is sleeping on this sleeper: its one timer cannot serve two.
        """
        if self._waiter is not None:
            raise RuntimeError("PreciseSleeper serves one task at a time; this one is already sleeping")
        fd = self._fd
        if fd is None:
            await asyncio.sleep(max(0.0, deadline - time.monotonic()))
            return
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(fd)
            loop.add_reader(fd, self._expired)
            self._loop = loop
        fraction, seconds = math.modf(max(deadline, 1e-9))
        self._spec.it_value.tv_sec = int(seconds)
        self._spec.it_value.tv_nsec = int(fraction * 1e9)
        assert _libc is not None  # a descriptor exists only with libc
        if _libc.timerfd_settime(fd, _TFD_TIMER_ABSTIME, ctypes.byref(self._spec), None) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"timerfd_settime: {os.strerror(errno)}")
        waiter = self._waiter = loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _expired(self) -> None:
        try:
            os.read(self._fd, 8)  # type: ignore[arg-type]  # registered only with a descriptor
        except BlockingIOError:
            return  # re-armed after it fired: the expiry was consumed by the new setting
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def close(self) -> None:
        """Unregister and close the timerfd; later sleeps use ``asyncio.sleep``."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(fd)
        self._loop = None
        os.close(fd)
