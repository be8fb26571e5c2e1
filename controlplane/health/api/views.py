"""``GET /api/v1/health/``: 200 when the control plane can do its work, 503 with the same body when not.

Open to anyone, as load balancers and monitors call it without a token; to them it says states, ages and
counts only. People who are logged in (a token or the dashboard's session) also get the reasons, the
broker's URL (password hidden) and what the last pass did, which name hosts.
"""

from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.accounts.models import User
from controlplane.health.api.serializers import HealthSerializer
from controlplane.health.checks import check_health


class HealthView(APIView):
    permission_classes = (AllowAny,)

    @extend_schema(
        auth=[],
        responses={
            200: HealthSerializer,
            503: OpenApiResponse(HealthSerializer, description="the database, the broker or the reconciler is down"),
        },
        description=(
            "The control plane's database, its broker (Redis, one PING of at most 0.5 s), the reconciler's last "
            "pass (late after 3 × FLOTILLA_RECONCILE_S + 10 s) and the agents seen. Needs no token; errors, URLs "
            "and the last pass's summary only to people who are logged in."
        ),
    )
    def get(self, request: Request) -> Response:
        health = check_health()
        body = health.as_dict(detail=isinstance(request.user, User))
        # Nobody may keep an old answer: a monitor must see the outage when it happens.
        return Response(body, status=200 if health.ok else 503, headers={"Cache-Control": "no-store"})
