"""Listening to the load metrics workers publish over NATS, from a synchronous test."""

import asyncio
import threading
from collections import defaultdict
from collections.abc import Callable
from types import TracebackType

import msgspec
import nats
from nats.aio.msg import Msg

from runtime.cluster.nats_connection import flush
from runtime.kv.events import WorkerLoad


class LoadWatcher:
    """Records every ``WorkerLoad`` published on ``subject``, per instance, on a background thread.

    Use as a context manager: on entry the subscription is live, on exit it is closed.
    """

    def __init__(self, nats_url: str, subject: str) -> None:
        self._url = nats_url
        self._subject = subject
        self._seen: dict[str, list[int]] = defaultdict(list)
        # Guards _seen; notified at each report (reentrant, so conditions may call active_requests).
        self._changed = threading.Condition(threading.RLock())
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="load watcher", daemon=True)

    def __enter__(self) -> "LoadWatcher":
        self._thread.start()
        self._ready.wait(10)
        if self._failure is not None or not self._ready.is_set():
            raise RuntimeError(f"could not subscribe to {self._subject}") from self._failure
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self._loop is not None and self._done is not None:
            self._loop.call_soon_threadsafe(self._done.set)
        self._thread.join(10)

    def active_requests(self, instance_id: str) -> list[int]:
        """The active-request counts instance ``instance_id`` (hex) published so far, oldest first."""
        with self._changed:
            return list(self._seen[instance_id])

    def last(self, instance_id: str) -> int | None:
        """The active-request count instance ``instance_id`` (hex) published last, if any."""
        with self._changed:
            seen = self._seen[instance_id]
            return seen[-1] if seen else None

    def wait_for(self, condition: Callable[["LoadWatcher"], bool], timeout: float, message: str) -> None:
        """Return once ``condition(self)`` holds, checked at each report; raise AssertionError(message) after
        ``timeout`` seconds."""
        with self._changed:
            if not self._changed.wait_for(lambda: condition(self), timeout):
                raise AssertionError(message)

    def _run(self) -> None:
        try:
            asyncio.run(self._listen())
        except BaseException as exc:  # reported by __enter__, or lost with the test that ended
            self._failure = exc
            self._ready.set()

    async def _listen(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._done = asyncio.Event()
        connection = await nats.connect(self._url)

        async def on_metrics(msg: Msg) -> None:
            metrics = msgspec.json.decode(msg.data, type=WorkerLoad)
            with self._changed:
                self._seen[f"{metrics.instance_id:x}"].append(metrics.active_requests)
                self._changed.notify_all()

        await connection.subscribe(self._subject, cb=on_metrics)
        await flush(connection)
        self._ready.set()
        await self._done.wait()
        await connection.close()
