"""ASGI entry point of the control plane (served by uvicorn): HTTP for the API and pages, websockets for
the dashboard's live updates (controlplane/live/), and uvicorn's lifespan messages."""

import os

from asgiref.wsgi import WsgiToAsgi
from channels.routing import ProtocolTypeRouter
from django.conf import settings
from django.core.wsgi import get_wsgi_application

from controlplane.body_limit import ASGIApp, Receive, Scope, Send, limit_body
from controlplane.request_threads import on_request_threads

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
# Django is set up here, before anything that imports models (the websocket routes do).
# HTTP runs Django's synchronous handler whole on a request thread: all its views and middleware are
# synchronous, and its ASGI handler would hop between the event loop and a thread for every middleware
# (WhiteNoise is sync-only, the others run process_request/response through sync_to_async): 9.8 -> 5.0 ms
# a small API call, one request at a time (docs/benchmarks.md).
http_application = WsgiToAsgi(get_wsgi_application())
#: Where files are uploaded (controlplane/batches/urls.py), and responses stored (stored_responses/urls.py).
UPLOAD_PATH = "/v1/files"
RESPONSES_PATH, STORE_SUFFIX = "/v1/responses/", "/store"

from controlplane.deployments.log_tail import log_tail_timeout_s  # noqa: E402
from controlplane.live.routing import websocket_application  # noqa: E402


def http_stack(app: ASGIApp) -> ASGIApp:
    """``app`` as the control plane serves HTTP, per the settings: its body read whole (within its deadline
    and size limit) before the request takes a thread of its lane, so a slow client holds no thread, and
    people, agents and log tails each on threads of their own."""
    on_threads = on_request_threads(
        app,
        settings.API_REQUEST_THREADS,
        agent_threads=settings.API_AGENT_THREADS,
        log_tail_threads=settings.API_LOG_TAIL_THREADS,
        log_tail_retry_after_s=log_tail_timeout_s(),
    )
    api = limit_body(on_threads, settings.API_MAX_BODY_BYTES, timeout_s=settings.API_BODY_TIMEOUT_S)
    # Uploads to /v1/files (batch input files, up to hundreds of MB) have a limit and a deadline of their own,
    # and so do stored responses (a long conversation is stored whole).
    uploads = limit_body(on_threads, settings.FILES_MAX_BYTES, timeout_s=settings.FILES_UPLOAD_TIMEOUT_S)
    stored = limit_body(on_threads, settings.RESPONSES_MAX_BYTES, timeout_s=settings.API_BODY_TIMEOUT_S)

    async def by_path(scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"].rstrip("/") if scope["type"] == "http" else ""
        if path == UPLOAD_PATH:
            await uploads(scope, receive, send)
        elif path.startswith(RESPONSES_PATH) and path.endswith(STORE_SUFFIX):
            await stored(scope, receive, send)
        else:
            await api(scope, receive, send)

    return by_path


async def lifespan(scope: Scope, receive: Receive, send: Send) -> None:
    """uvicorn's start-up and shutdown messages, acknowledged: nothing is set up for them (Django is, on
    import). Without it Channels' router raised ValueError at every start, which uvicorn logs as a protocol
    the app does not support."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


application = ProtocolTypeRouter(
    {"http": http_stack(http_application), "websocket": websocket_application(), "lifespan": lifespan}
)
