"""ASGI entry point of the control plane (served by uvicorn)."""

import os

from django.conf import settings
from django.core.asgi import get_asgi_application

from controlplane.body_limit import limit_body

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
application = limit_body(get_asgi_application(), settings.API_MAX_BODY_BYTES)
