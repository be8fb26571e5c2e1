"""The NATS connection of a process: waited for at start-up, reconnecting for ever after a loss."""

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from runtime.cluster.server_wait import ServerWait
from runtime.errors import RequestPlaneUnavailable
from runtime.rate_limited_log import RateLimitedLog
from runtime.settings import nats_servers, parse_nats_servers

log = logging.getLogger(__name__)

# nats-py retries a server this often, for the first connection as after a loss.
RECONNECT_WAIT = 0.5
# Messages dropped because a subscription fell behind are reported at most this often.
SLOW_CONSUMER_REPORT_S = 5.0


async def connect_nats(
    servers: str | list[str] | None = None,
    *,
    name: str,
    on_event: Callable[[str], Awaitable[None]] | None = None,
    wait: float | None = None,
) -> NATS:
    """Connect to NATS (``servers``, default ``$NATS_SERVER``), then reconnect for ever after a loss.

    A server that does not answer yet is retried until it does, with a warning within a second that
    names it and how to start one, and a reminder every few seconds (runtime/cluster/server_wait.py); nats-py
    re-subscribes by itself after a reconnection. Raises ConfigError for a malformed server address,
    RequestPlaneUnavailable if no server answered within ``wait`` seconds (None: wait for ever).
    """
    if isinstance(servers, str):
        servers = parse_nats_servers(servers)
    urls = nats_servers() if servers is None else servers
    address = ", ".join(urls)
    waiting = ServerWait("NATS", address, variable="NATS_SERVER", error=RequestPlaneUnavailable)
    nc = NATS()

    async def note(kind: str) -> None:
        # Draining on a clean shutdown also "disconnects": only an unexpected loss is a warning.
        level = logging.DEBUG if nc.is_draining or nc.is_closed else logging.WARNING
        log.log(level, "NATS %s (%s)", kind, address)
        if on_event is not None:
            await on_event(kind)

    async def disconnected() -> None:
        await note("disconnected")

    async def reconnected() -> None:
        await note("reconnected")

    slow_consumer = RateLimitedLog(log, period_s=SLOW_CONSUMER_REPORT_S)

    async def error(exc: Exception) -> None:
        if not nc.is_connected:
            waiting.failed(exc)  # shown in the next "cannot reach" warning
            log.debug("NATS error: %s", exc)
        elif isinstance(exc, nats.errors.SlowConsumerError):
            # nats-py drops what a subscription cannot queue: the streams waiting for it will break.
            slow_consumer.warning(
                f"NATS: this process reads too slowly and dropped a message (subject {exc.subject}); it is overloaded"
            )
        else:
            log.warning("NATS error (%s): %s", address, exc)

    options: dict[str, Any] = {
        "name": name,
        # With reconnection allowed and no limit on attempts, nats-py also retries the first connection.
        "allow_reconnect": True,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": RECONNECT_WAIT,
        "connect_timeout": 2,
        "disconnected_cb": disconnected,
        "reconnected_cb": reconnected,
        "error_cb": error,
    }
    try:
        await waiting.wait(nc.connect(urls, **options), limit=wait)
    except (TimeoutError, nats.errors.NoServersError, OSError) as exc:
        await nc.close()
        raise RequestPlaneUnavailable(waiting.message()) from exc
    except BaseException:
        # Cancelled (a signal during start-up) or out of time: stop the attempts in the background too.
        await nc.close()
        raise
    return nc


async def flush(nc: NATS, within: float = 10.0) -> None:
    """Wait until the server has processed all we sent (a PING round trip), up to ``within`` s.

    Use this, not ``nc.flush(timeout)``, for two faults of nats-py 2.16:

    * Its ``flush`` writes the PING straight to the socket, while what was sent before (a SUB, a PUB)
      may still wait in its buffer for the flusher task. The PONG can then come back before the
      server has seen them: a subscription "confirmed" that way was missed by another connection's
      publish ("no responders") about once in 20 under CPU load. So the buffer is written out first
      (the flusher's own forced flush), and the PING goes after it.
    * It cancels the PONG's future when a flush times out, and when that PONG arrives later its
      reader raises InvalidStateError and stops for good; the connection then looks alive and
      delivers nothing. Here only our wait ends; the PING's own wait has no limit.

    Raises TimeoutError, or nats.errors.Error when there is no connection.
    """

    async def written_then_pinged() -> None:
        await nc._flush_pending(force_flush=True)  # private, in nats-py 2.16 (pinned): the buffer, written
        await nc.flush(timeout=_NO_LIMIT)

    await asyncio.wait_for(asyncio.shield(written_then_pinged()), within)


async def consume(nc: NATS, subject: str, handle: Callable[[Msg], None], *, subscribed: asyncio.Event) -> None:
    """Subscribe to ``subject`` and give ``handle`` each message, in order, until cancelled; set
    ``subscribed`` once the subscription is made. An exception from ``handle`` ends the subscription
    and is raised here, so the supervisor that owns the caller logs it and subscribes again.

    For subjects every router replica hears (KV events, load reports, the replicas' decisions) rather
    than ``subscription.messages``: nats-py's iterator starts a task and an ``asyncio.wait`` for each
    message, where a callback subscription takes one queue get (about half the CPU per message:
    bench/nats_consume.py).
    """
    failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def deliver(message: Msg) -> None:
        if failed.done():
            return  # unsubscribing: the messages still queued are dropped, as a new subscription would miss them
        try:
            handle(message)
        except Exception as exc:  # not lost: raised to the caller's supervisor below
            failed.set_exception(exc)

    subscription = await nc.subscribe(subject, cb=deliver)
    try:
        subscribed.set()
        await failed
    finally:
        with contextlib.suppress(Exception):  # the connection may be closing already
            await subscription.unsubscribe()


# How long a process that stops waits for NATS to take what it sent before it closes the connection anyway.
CLOSE_FLUSH_S = 2.0


async def close_nats(nc: NATS, within: float = CLOSE_FLUSH_S) -> None:
    """Flush what ``nc`` sent (up to ``within`` seconds), then close it; never raises.

    Not nats-py's ``drain``: it waits up to 10 s per flush, twice, for a server that dies during it (a whole
    stack stopped at once), and swallows a cancellation meanwhile, so a process stopping on SIGTERM outlived
    its supervisor's patience. What drain adds, handling the messages already queued for this process's
    subscriptions, no caller needs: servers stop taking requests before they close (runtime/request_plane).
    """
    if not nc.is_closed:
        if nc.is_connected:
            with contextlib.suppress(Exception):  # out of time, or the connection lost meanwhile
                await flush(nc, within)
        with contextlib.suppress(Exception):
            await nc.close()
    await _end_reconnecting(nc)


async def _end_reconnecting(nc: NATS, attempts: int = 20) -> None:
    """Make sure nats-py's reconnection task has ended once ``nc`` is closed.

    Cancelled at the wrong moment of a connection attempt, that task can lose the cancellation (Python 3.11's
    ``wait_for`` returns the attempt's error instead) and set the client back to reconnecting: it then tries
    a dead server for ever, and ``asyncio.run`` waits for it at exit, so the process never ends (seen with a
    whole `flotilla up` killed at once). It is cancelled again until it ends; it sleeps between attempts.
    """
    task = nc._reconnection_task  # private, in nats-py 2.16 (pinned)
    for _ in range(attempts):
        if task is None or task.done():
            return
        task.cancel()
        await asyncio.wait({task}, timeout=RECONNECT_WAIT / 2)
    log.warning("NATS: the client's reconnection task did not end when cancelled %d times", attempts)


# nats-py's flush takes a number of seconds; this one outlasts any process.
_NO_LIMIT = 10**9
