"""A small HTTP server on the event loop that answers ``GET /metrics`` with a Prometheus exposition.

For processes that serve no HTTP of their own (a worker): a scrape is one short request on a fresh
connection, so this speaks just enough HTTP/1.1 for it (one request per connection, then close) rather
than bring up an ASGI server, whose signal handling would fight the worker's own. Everything runs on
the worker's event loop, so the exposition reads the engine's state from the loop that changes it (no
lock, no thread); building it takes a fraction of a millisecond. A client that sends nothing, or too
much, is dropped after ``READ_TIMEOUT_S`` or ``MAX_HEAD_BYTES``.
"""

import asyncio
import contextlib
import logging
from collections.abc import Callable

from runtime.errors import ConfigError

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 5.0
MAX_HEAD_BYTES = 8192
#: What prometheus_client's generate_latest writes (the gateway's /metrics says the same).
EXPOSITION_TYPE = "text/plain; version=0.0.4; charset=utf-8"


async def serve_metrics(host: str, port: int, exposition: Callable[[], bytes]) -> asyncio.Server:
    """Answer ``GET /metrics`` on ``host:port`` with ``exposition()`` until the server is closed.

    Raises ConfigError when the address cannot be listened on (a port taken, an unknown host).
    """

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(READ_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
            method, _, rest = head.partition(b" ")
            path = rest.partition(b" ")[0].partition(b"?")[0]
            if path != b"/metrics":
                status, body, content_type = "404 Not Found", b"not found: try /metrics\n", "text/plain"
            elif method not in (b"GET", b"HEAD"):
                status, body, content_type = "405 Method Not Allowed", b"use GET\n", "text/plain"
            else:
                status, body, content_type = "200 OK", exposition(), EXPOSITION_TYPE
            header = (
                f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n"
            )
            writer.write(header.encode() + (b"" if method == b"HEAD" else body))
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass  # a client that left, or sent no request in time, or a head too long: nothing to answer
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    try:
        server = await asyncio.start_server(answer, host, port, limit=MAX_HEAD_BYTES)
    except OSError as exc:
        raise ConfigError(
            f"cannot serve metrics on {host}:{port} ({exc.strerror or exc}): choose another --metrics-port"
        ) from exc
    log.info("metrics on http://%s:%d/metrics", host, port)
    return server
