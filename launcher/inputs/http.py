"""``in=http``: serve models over the OpenAI HTTP API with uvicorn (uvloop + httptools)."""

import logging
import socket
import sys
from typing import TextIO

import uvicorn

from frontend_gateway.http_app import GatewayApp
from frontend_gateway.pipeline import ModelRegistry
from runtime.errors import ConfigError

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


def bind_socket(host: str, port: int) -> socket.socket:
    """Listen on host:port, or raise ConfigError saying why not (uvicorn would exit the process)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"cannot listen on {host}:{port}: {exc.strerror}; pick another --http-port (FLOTILLA_HTTP_PORT)"
        ) from exc
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


async def serve_http(
    models: ModelRegistry, *, host: str, port: int, max_body_bytes: int, banner: TextIO | None = sys.stdout
) -> None:
    """Serve until SIGINT/SIGTERM (uvicorn re-raises the signal once it has shut down cleanly)."""
    sock = bind_socket(host, port)
    app = GatewayApp(models, max_body_bytes=max_body_bytes)
    config = uvicorn.Config(
        app,
        loop="none",  # the caller's loop (uvloop, installed by the CLI)
        http="httptools",
        lifespan="on",
        log_level="warning",
        access_log=False,
        timeout_keep_alive=30,
        backlog=2048,
    )
    server = uvicorn.Server(config)
    with sock, server.capture_signals():
        config.load()
        server.lifespan = config.lifespan_class(config)
        await server.startup(sockets=[sock])
        if server.should_exit:
            raise ConfigError("the HTTP server failed to start; see the log above")
        if banner is not None:
            print(usage_banner(host, port, models.names()), file=banner, flush=True)
        await server.main_loop()
        await server.shutdown(sockets=[sock])
