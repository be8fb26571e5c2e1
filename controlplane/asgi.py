"""ASGI entry point of the control plane (served by uvicorn)."""

import os

from django.conf import settings
from django.core.asgi import get_asgi_application

from controlplane.body_limit import limit_body
from controlplane.request_threads import on_request_threads

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
application = limit_body(
    on_request_threads(get_asgi_application(), settings.API_REQUEST_THREADS), settings.API_MAX_BODY_BYTES
)
