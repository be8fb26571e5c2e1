"""/api/v1/: each app's router, the OpenAPI schema and its Swagger page."""

from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.permissions import AllowAny

urlpatterns = [
    path("", include("controlplane.catalog.api.urls")),
    path("", include("controlplane.fleet.api.urls")),
    path("", include("controlplane.deployments.api.urls")),
    path("", include("controlplane.planning.api.urls")),
    path("", include("controlplane.audit.api.urls")),
    path("", include("controlplane.accounts.api.urls")),
    path("", include("controlplane.health.api.urls")),
    path("", include("controlplane.apikeys.api.urls")),
    path("", include("controlplane.alerts.api.urls")),
    # The API's shape is no secret; what it returns needs a token.
    path("schema/", SpectacularAPIView.as_view(permission_classes=[AllowAny]), name="schema"),
    path(
        "docs/",
        SpectacularSwaggerView.as_view(url_name="schema", permission_classes=[AllowAny]),
        name="swagger-ui",
    ),
]
