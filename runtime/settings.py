"""The environment variables of the serving path, one reader each.

The code that uses a setting reads it through its reader here, and ``check_settings()`` reads them
all, so that a process can refuse a bad value at start-up (``flotilla run`` exits 2 naming it) rather
than fail with a traceback when the value is first used, perhaps minutes later. Each reader raises
ConfigError naming the variable.

This module imports nothing heavy: ``flotilla run in=text`` checks these without loading NATS or etcd.
"""

from urllib.parse import urlsplit

from runtime.config import env_float, env_int, env_str
from runtime.errors import ConfigError

DEFAULT_NATS_SERVER = "nats://127.0.0.1:4222"
DEFAULT_ETCD_ENDPOINT = "http://127.0.0.1:2379"
DEFAULT_LEASE_TTL = 10.0
# NATS's own default max_payload; runtime/request_plane/wire.py uses the same default for library callers.
DEFAULT_MAX_REQUEST_BYTES = 1 << 20
_NATS_SCHEMES = ("nats", "tls", "ws", "wss")


def parse_nats_servers(text: str) -> list[str]:
    """``nats://host:port`` (or ``host:port``), comma-separated -> the URLs, each with a scheme.

    Raises ConfigError for anything nats-py would refuse or misread.
    """
    servers = []
    for part in filter(None, (piece.strip() for piece in text.split(","))):
        url = part if "://" in part else f"nats://{part}"
        parsed = urlsplit(url)
        try:
            port = parsed.port
        except ValueError:
            port = -1
        if parsed.scheme not in _NATS_SCHEMES or not parsed.hostname or port == -1 or parsed.path not in ("", "/"):
            raise ConfigError(f"NATS_SERVER: {part!r} is not of the form nats://host:port")
        servers.append(url)
    if not servers:
        raise ConfigError("NATS_SERVER is empty: give a server as nats://host:port")
    return servers


def nats_servers() -> list[str]:
    """``$NATS_SERVER`` (comma-separated; default nats://127.0.0.1:4222) as URLs. Raises ConfigError."""
    return parse_nats_servers(env_str("NATS_SERVER") or DEFAULT_NATS_SERVER)


def parse_etcd_endpoint(text: str) -> tuple[str, int]:
    """``http://host:port`` (or ``host:port``; the port defaults to 2379) -> (host, port).

    Raises ConfigError for anything else, https included: we do not speak TLS to etcd.
    """
    stripped = text.strip()
    url = urlsplit(stripped if "://" in stripped else f"http://{stripped}")
    try:
        port = url.port or 2379
    except ValueError:
        port = -1
    if url.scheme != "http" or not url.hostname or port < 0 or url.path not in ("", "/") or url.query:
        raise ConfigError(f"etcd endpoint {text!r} is not of the form http://host:port (check ETCD_ENDPOINTS)")
    return url.hostname, port


def etcd_endpoints() -> list[str]:
    """``$ETCD_ENDPOINTS`` (comma-separated; default http://127.0.0.1:2379), each checked. Raises ConfigError."""
    endpoints = [part.strip() for part in (env_str("ETCD_ENDPOINTS") or DEFAULT_ETCD_ENDPOINT).split(",")]
    endpoints = [endpoint for endpoint in endpoints if endpoint]
    if not endpoints:
        raise ConfigError("ETCD_ENDPOINTS is empty: give an endpoint as http://host:port")
    for endpoint in endpoints:
        parse_etcd_endpoint(endpoint)
    return endpoints


def lease_ttl() -> float:
    """``$FLOTILLA_LEASE_TTL``: seconds an instance outlives its last lease refresh (default 10, at least 1)."""
    return env_float("FLOTILLA_LEASE_TTL", DEFAULT_LEASE_TTL, minimum=1.0)


def stream_heartbeat_seconds() -> float:
    """``$FLOTILLA_STREAM_HEARTBEAT_S``: a worker's heartbeat on a quiet stream (default 1, at least 0.05)."""
    return env_float("FLOTILLA_STREAM_HEARTBEAT_S", 1.0, minimum=0.05)


def stream_silence_seconds() -> float:
    """``$FLOTILLA_STREAM_SILENCE_S``: silence after which a stream's worker counts as dead (default 5)."""
    return env_float("FLOTILLA_STREAM_SILENCE_S", 5.0, minimum=0.1)


def stream_ack_deadline_seconds() -> float:
    """``$FLOTILLA_STREAM_ACK_DEADLINE_S``: how long a worker keeps generating for a stream whose window is
    full while its client says nothing, no ack and no probe (default 5, at least 0.1); then it stops it."""
    return env_float("FLOTILLA_STREAM_ACK_DEADLINE_S", 5.0, minimum=0.1)


def stream_gone_after_seconds() -> float:
    """``$FLOTILLA_STREAM_GONE_AFTER_S``: how long an instance's probes must find nobody listening, back to
    back, before the ingress breaks its streams (default 1, at least 0; a connection blip is shorter)."""
    return env_float("FLOTILLA_STREAM_GONE_AFTER_S", 1.0, minimum=0.0)


def stream_progress_deadline_seconds() -> float:
    """``$FLOTILLA_STREAM_PROGRESS_DEADLINE_S``: how long an ingress waits for a stream's next output while its
    worker's heartbeats say it is there (default 60; 0: for ever). Before the first output it waits as long
    as the worker's engine makes progress on other streams. Then the stream is migrated, or fails."""
    return env_float("FLOTILLA_STREAM_PROGRESS_DEADLINE_S", 60.0, minimum=0.0)


def max_waiting_requests() -> int:
    """``$FLOTILLA_MAX_WAITING_REQUESTS``: requests a worker lets wait for its engine (its engine's queue where
    the engine reports one, else every request it holds) before it refuses new ones as busy (default 0: no
    limit); the ingress then tries another instance."""
    return env_int("FLOTILLA_MAX_WAITING_REQUESTS", 0, minimum=0)


def max_request_bytes() -> int:
    """``$FLOTILLA_MAX_REQUEST_BYTES``: the largest request a worker accepts (default 1 MiB, at least 1 KiB)."""
    return env_int("FLOTILLA_MAX_REQUEST_BYTES", DEFAULT_MAX_REQUEST_BYTES, minimum=1024)


def drain_grace_seconds() -> float:
    """How long a worker shutting down lets requests in flight finish (``FLOTILLA_DRAIN_S``, default 10)."""
    return env_float("FLOTILLA_DRAIN_S", 10.0, minimum=0.0)


def check_settings() -> None:
    """Read every setting above once. Raises ConfigError for the first bad one."""
    nats_servers()
    etcd_endpoints()
    lease_ttl()
    stream_heartbeat_seconds()
    stream_silence_seconds()
    stream_ack_deadline_seconds()
    stream_gone_after_seconds()
    stream_progress_deadline_seconds()
    max_waiting_requests()
    max_request_bytes()
    drain_grace_seconds()
