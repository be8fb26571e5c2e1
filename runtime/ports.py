"""Choosing a free TCP port for a server that another process will start, a moment later.

The usual way, binding port 0 and closing the socket, returns a port from the kernel's ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default). The kernel hands the same range out to every
outgoing connection and every other ``bind(0)``, so in the seconds before the server binds it (a vLLM engine binds
its KV event publisher after loading its weights) the port can be taken: CI lost a vLLM worker so ("Address
already in use (addr='tcp://*:40191')"). Ports chosen here lie below that range, where the kernel never puts a
socket of its own; only another process choosing a port the same way could take one, and each is checked free
when it is chosen.
"""

from __future__ import annotations

import random
import socket
from collections import deque
from collections.abc import Iterable
from pathlib import Path

#: The lowest port chosen: below it lie the well-known and commonly configured ports (8000, 8080, 9090...).
LOWEST = 10000
#: The kernel's ephemeral range when /proc does not say (Linux's default).
DEFAULT_EPHEMERAL = (32768, 60999)
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")

# The ports this process handed out lately: a caller often chooses several before starting anything (etcd's client
# and peer ports), and a random choice must not give the same port twice in the meantime.
_handed_out: deque[int] = deque(maxlen=512)


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range, both ends included."""
    try:
        low, high = (int(part) for part in _RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL
    return low, high


def ports_free(ports: Iterable[int], host: str = "127.0.0.1") -> bool:
    """Whether a server could listen on each of ``ports`` on ``host`` now."""
    try:
        for port in ports:
            with socket.socket() as probe:
                # As servers bind (etcd, NATS, ZMQ, uvicorn): a port in TIME_WAIT after a stopped server is free.
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((host, port))
    except OSError:
        return False
    return True


def _candidates(count: int) -> list[range]:
    """The stretches of ports outside the ephemeral range that ``count`` consecutive ports can start in."""
    low, high = ephemeral_range()
    spans = [range(LOWEST, low - count + 1), range(high + 1, 65536 - count + 1)]
    return [span for span in spans if len(span) > 0]


def free_ports(count: int = 1, host: str = "127.0.0.1", attempts: int = 200) -> int:
    """The first of ``count`` consecutive ports, outside the kernel's ephemeral range, that are free on ``host``
    now and that this process has not handed out lately. Raises OSError when ``attempts`` random tries find none."""
    spans = _candidates(count)
    if spans:
        for _ in range(attempts):
            span = random.choice(spans)
            first = random.choice(span)
            wanted = range(first, first + count)
            if any(port in _handed_out for port in wanted) or not ports_free(wanted, host):
                continue
            _handed_out.extend(wanted)
            return first
    raise OSError(f"no {count} consecutive free ports on {host} outside the ephemeral range {ephemeral_range()}")


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on ``host`` now, outside the kernel's ephemeral range."""
    return free_ports(1, host)
