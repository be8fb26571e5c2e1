"""``in=http``: serve models over the OpenAI HTTP API with uvicorn (uvloop + httptools)."""

import asyncio
import logging
import resource
import signal
import socket
import sys
from typing import TextIO

import msgspec
import uvicorn

from frontend_gateway.access.api_keys import KeyTable
from frontend_gateway.access.quotas import Meter
from frontend_gateway.admission import AdmissionLimits
from frontend_gateway.control_plane_proxy import ControlPlaneProxy
from frontend_gateway.http_app import GatewayApp
from frontend_gateway.metrics import GatewayMetrics
from frontend_gateway.models.pipeline import ModelRegistry
from frontend_gateway.models.served_names import ServedNames
from launcher.metrics_server import serve_metrics
from launcher.options import RunOptions
from runtime.errors import ConfigError
from runtime.http_head_deadline import head_deadline_protocol

log = logging.getLogger(__name__)


def usage_banner(host: str, port: int, model_names: list[str]) -> str:
    """How to talk to the server: printed once it listens."""
    shown_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    base = f"http://{shown_host}:{port}"
    model = model_names[0] if model_names else "MODEL"
    return f"""\
Flotilla is serving {", ".join(model_names) or "no models yet"} on {base}

  curl {base}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}'

  python -c 'from openai import OpenAI
c = OpenAI(base_url="{base}/v1", api_key="none")
r = c.chat.completions.create(model="{model}", messages=[{{"role": "user", "content": "Hi!"}}])
print(r.choices[0].message.content)'

  Models: {base}/v1/models   Health: {base}/health   Metrics: {base}/metrics   (Ctrl-C stops)
"""


def timeout_error_body(message: str) -> bytes:
    """A 408 ``request_timeout`` error in OpenAI's shape (the head deadline's, runtime/http_head_deadline.py)."""
    return msgspec.json.encode({"error": {"message": message, "type": "request_timeout", "code": "request_timeout"}})


def admission_limits(options: RunOptions) -> AdmissionLimits:
    """The admission control settings of ``--max-inflight``, ``--max-queued`` and ``--queue-timeout``."""
    return AdmissionLimits(
        max_inflight=options.max_inflight, max_queued=options.max_queued, queue_timeout_s=options.queue_timeout_s
    )


# Connections the kernel holds before we accept them: a burst of thousands of clients must not be reset.
# (The kernel caps it at net.core.somaxconn.)
LISTEN_BACKLOG = 8192


def raise_open_file_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit; return the limit now in force.

    Every client connection is a file descriptor, and the usual soft limit (1024) would refuse
    connections long before memory or CPU run out (Go and nginx raise it the same way).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, hard, exc)
            return soft
    return hard


def bind_socket(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """Listen on host:port, or raise ConfigError saying why not (uvicorn would exit the process).

    With ``reuse_port`` several processes may listen on the same port (SO_REUSEPORT): the kernel
    spreads new connections over them, so an ingress can use more than one core.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        share = "" if reuse_port else ", or give every process sharing it --reuse-port (FLOTILLA_REUSE_PORT)"
        raise ConfigError(
            f"cannot listen on {host}:{port}: {exc.strerror}; pick another --http-port (FLOTILLA_HTTP_PORT){share}"
        ) from exc
    sock.listen(LISTEN_BACKLOG)
    sock.set_inheritable(True)
    return sock


async def serve_http(
    models: ModelRegistry,
    options: RunOptions,
    *,
    metrics: GatewayMetrics | None = None,
    stop: asyncio.Event | None = None,
    banner: TextIO | None = sys.stdout,
    api_keys: KeyTable | None = None,
    meter: Meter | None = None,
    served_names: ServedNames | None = None,
    max_concurrent_per_key: int | None = None,
    control_plane: ControlPlaneProxy | None = None,
) -> int | None:
    """Serve until SIGINT/SIGTERM or ``stop``; return the signal that stopped it, if one did.

    A first signal shuts down gracefully (streams in flight finish); a second one cuts them. ``options`` gives
    the address and the HTTP limits (``--http-host``/``--http-port``, body size and deadlines, images, admission,
    CORS origins); the keywords are what only the distributed ingress has.
    """
    files = raise_open_file_limit()
    log.debug("open-file limit %d", files)
    host, port = options.http_host, options.http_port
    sock = bind_socket(host, port, reuse_port=options.reuse_port)
    app = GatewayApp(
        models,
        max_body_bytes=options.max_body_bytes,
        body_timeout_s=options.body_timeout_s,
        send_timeout_s=options.send_timeout_s,
        image_limits=options.image_limits,
        limits=admission_limits(options),
        metrics=metrics,
        api_keys=api_keys,
        meter=meter,
        served_names=served_names,
        max_concurrent_per_key=max_concurrent_per_key,
        control_plane=control_plane,
        allowed_origins=options.allowed_origins,
    )
    head_timeout_s = options.header_timeout_s
    config = uvicorn.Config(
        app,
        loop="none",  # the caller's loop (uvloop, installed by the CLI)
        # httptools, with a deadline on each request's headers (uvicorn keeps none)
        http=head_deadline_protocol(
            head_timeout_s, lambda client: app.slow_clients.dropped_head(client, head_timeout_s), timeout_error_body
        ),
        lifespan="on",
        log_level="warning",
        access_log=False,
        timeout_keep_alive=30,
        backlog=LISTEN_BACKLOG,
    )
    server = uvicorn.Server(config)
    received: list[int] = []

    def on_signal(signum: int) -> None:
        # Our own handlers rather than uvicorn's capture_signals(), which re-raises the signal after
        # shutting down and so kills the process before its caller can close what it owns (NATS, etcd).
        received.append(signum)
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True

    loop = asyncio.get_running_loop()
    # --metrics-port: this process's own /metrics, which --http-port gives only when no other process shares it.
    metrics_server = None
    if options.metrics_port is not None:
        metrics_server = await serve_metrics(host, options.metrics_port, app.metrics.exposition)
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        await _serve(server, sock, config, models, host, port, stop, banner)
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
        if metrics_server is not None:
            metrics_server.close()
            await metrics_server.wait_closed()
    return received[0] if received else None


async def _serve(
    server: uvicorn.Server,
    sock: socket.socket,
    config: uvicorn.Config,
    models: ModelRegistry,
    host: str,
    port: int,
    stop: asyncio.Event | None,
    banner: TextIO | None,
) -> None:
    with sock:
        config.load()
        server.lifespan = config.lifespan_class(config)
        await server.startup(sockets=[sock])
        if not server.started:
            raise ConfigError("the HTTP server failed to start; see the log above")
        if banner is not None:
            print(usage_banner(host, port, models.names()), file=banner, flush=True)
        stopper = asyncio.create_task(_exit_when_set(stop, server)) if stop is not None else None
        try:
            await server.main_loop()
        finally:
            if stopper is not None:
                stopper.cancel()
        await server.shutdown(sockets=[sock])


async def _exit_when_set(stop: asyncio.Event, server: uvicorn.Server) -> None:
    """Shut ``server`` down as a signal would, once ``stop`` is set."""
    await stop.wait()
    server.should_exit = True
