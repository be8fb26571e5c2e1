"""A deadline on each request's head (its request line and headers), which uvicorn does not keep.

uvicorn arms no timer on a new connection, and any byte received cancels its keep-alive timer. A client that
connects and sends nothing, or trickles its headers a byte at a time, keeps its connection (a file
descriptor and a protocol object) for as long as it likes. That is the slow-headers attack ("Slowloris"): a
few thousand sockets from one machine hold a server that has no proxy in front of it.

The protocol ``head_deadline_protocol`` makes is uvicorn's httptools protocol with one timer more. The timer
starts when a connection opens (its first request) or when a later request's first byte arrives. The head
must be complete, its headers parsed, within ``head_timeout_s``; bytes trickled in do not extend it. At the
deadline a client that has begun a head gets a 408 and the connection is closed. A connection that has sent
nothing at all is closed without a word (a browser's preconnect, or a scan). An idle keep-alive connection
between requests is still uvicorn's own business (``timeout_keep_alive``). Each drop is told to the caller's
``on_drop``: the gateway counts it in ``flotilla_frontend_slow_clients_dropped_total{reason="head"}``, and
both it and the control plane (controlplane/http_protocol.py) log it, at most once a minute.
"""

import asyncio
import logging
from collections.abc import Callable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)

#: A request's head must arrive whole within this many seconds of its first byte (or of the connection).
DEFAULT_HEAD_TIMEOUT_S = 30.0


def timeout_message(head_timeout_s: float) -> str:
    """What the 408's body says."""
    return f"the request's headers did not arrive within {head_timeout_s:g} s; the connection is closed"


def timeout_response(error_body: bytes) -> bytes:
    """The 408 sent to a client whose head did not arrive in time, with ``error_body`` (JSON)."""
    head = (
        b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"content-length: %d\r\n\r\n" % len(error_body)
    )
    return head + error_body


def head_deadline_protocol(
    head_timeout_s: float, on_drop: Callable[[str], None], error_body: Callable[[str], bytes]
) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol, holding each request's head to ``head_timeout_s`` (module docstring).
    ``on_drop`` is told who was dropped ("host:port") before the connection is closed; ``error_body`` makes
    the 408's JSON body from its message, in the caller's shape of errors."""
    response = timeout_response(error_body(timeout_message(head_timeout_s)))

    class HeadDeadlineProtocol(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None
        _head_begun = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_head_deadline()

        def on_message_begin(self) -> None:
            self._head_begun = True
            if self._head_timer is None:  # a later request on this connection: its own deadline
                self._arm_head_deadline()
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._disarm_head_deadline()
            self._head_begun = False
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head_deadline()
            super().connection_lost(exc)

        def _arm_head_deadline(self) -> None:
            self._head_timer = self.loop.call_later(head_timeout_s, self._head_expired)

        def _disarm_head_deadline(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_expired(self) -> None:
            self._head_timer = None
            if self.transport.is_closing():
                return
            client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
            on_drop(client)
            if self._head_begun:
                self.transport.write(response)
            self.transport.close()

    return HeadDeadlineProtocol
