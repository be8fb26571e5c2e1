"""The websocket routes of the control plane (controlplane/asgi.py mounts them)."""

from channels.auth import AuthMiddlewareStack
from channels.routing import URLRouter
from channels.security.websocket import AllowedHostsOriginValidator
from django.urls import path

from controlplane.body_limit import ASGIApp
from controlplane.live.consumers import FleetConsumer, InstanceConsumer, PipelineConsumer
from controlplane.live.rendering import SharedRenders


def websocket_application() -> ASGIApp:
    """The dashboard's sockets: logged-in sessions only, from pages of an allowed host only (a page
    elsewhere cannot ride a person's session cookie)."""
    renders = SharedRenders()  # one per application: its sockets share renders
    routes = URLRouter(
        [
            path("ws/fleet/", FleetConsumer.as_asgi(renders=renders)),
            path("ws/pipelines/<int:pk>/", PipelineConsumer.as_asgi(renders=renders)),
            path("ws/instances/<int:pk>/", InstanceConsumer.as_asgi(renders=renders)),
        ]
    )
    application: ASGIApp = AllowedHostsOriginValidator(AuthMiddlewareStack(routes))
    return application
