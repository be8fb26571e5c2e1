"""ASGI entry point of the control plane (served by uvicorn): HTTP for the API and pages, websockets for
the dashboard's live updates (controlplane/live/)."""

import os

from asgiref.wsgi import WsgiToAsgi
from channels.routing import ProtocolTypeRouter
from django.conf import settings
from django.core.wsgi import get_wsgi_application

from controlplane.body_limit import limit_body
from controlplane.request_threads import on_request_threads

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
# Django is set up here, before anything that imports models (the websocket routes do).
# HTTP runs Django's synchronous handler whole on a request thread: all its views and middleware are
# synchronous, and its ASGI handler would hop between the event loop and a thread for every middleware
# (WhiteNoise is sync-only, the others run process_request/response through sync_to_async): 9.8 -> 5.0 ms
# a small API call, one request at a time (docs/benchmarks.md).
http_application = WsgiToAsgi(get_wsgi_application())

from controlplane.live.routing import websocket_application  # noqa: E402

application = ProtocolTypeRouter(
    {
        "http": limit_body(
            on_request_threads(http_application, settings.API_REQUEST_THREADS), settings.API_MAX_BODY_BYTES
        ),
        "websocket": websocket_application(),
    }
)
