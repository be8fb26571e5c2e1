"""The control plane's HTTP protocol for uvicorn: httptools with a deadline on each request's headers.

uvicorn keeps none, so a client that connects and sends nothing, or trickles its headers, would hold a
connection for as long as it liked (runtime/http_head_deadline.py says more). The control plane's servers
name this class: ``uvicorn --http controlplane.http_protocol:HeadDeadlineProtocol`` (``flotilla up``, the
systemd unit, the tests' control plane). The deadline is ``FLOTILLA_API_HEADER_TIMEOUT_S`` (10 s, as the
API's body deadline); a client dropped at it is logged, at most once a minute, and one whose headers had
begun gets a 408 ``{"detail": ...}`` like the API's other errors.
"""

import json
import logging

from runtime.config import env_float
from runtime.http_head_deadline import head_deadline_protocol
from runtime.rate_limited_log import RateLimitedLog

HEADER_TIMEOUT_S = env_float("FLOTILLA_API_HEADER_TIMEOUT_S", 10.0, minimum=0.1)

_dropped = RateLimitedLog(logging.getLogger(__name__), period_s=60.0)


def _on_drop(client: str) -> None:
    _dropped.warning(
        f"dropped {client}: its request headers did not arrive within {HEADER_TIMEOUT_S:g} s "
        "(FLOTILLA_API_HEADER_TIMEOUT_S)"
    )


def _error_body(message: str) -> bytes:
    return json.dumps({"detail": message}).encode()


HeadDeadlineProtocol = head_deadline_protocol(HEADER_TIMEOUT_S, _on_drop, _error_body)
