"""The charts' history as JSON (``/metrics/history/?scope=fleet|pipeline|node&id=…&range=1h|6h|24h``), for
static/dashboard/history_charts.js: the control plane's samples, or Prometheus's where FLOTILLA_PROMETHEUS_URL is
set (node figures always come from the samples). Bad input is a 400 with its reason, Prometheus failing a 502 with
its own; never a 500."""

import time

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, JsonResponse
from django.shortcuts import get_object_or_404
from django.views.decorators.http import require_GET

from controlplane.deployments.models import Pipeline
from controlplane.fleet.models import Node
from controlplane.traffic.history import RANGES, sample_history
from controlplane.traffic.models import MetricSample
from controlplane.traffic.prometheus import PrometheusError, PrometheusReader
from runtime.config import env_str

#: Prometheus's step for a range: about 360 points.
_STEPS = {seconds: max(10, seconds // 360) for seconds in RANGES.values()}


@login_required
@require_GET
def metrics_history(request: HttpRequest) -> JsonResponse:
    scope = request.GET.get("scope", MetricSample.Scope.FLEET)
    if scope not in MetricSample.Scope.values:
        return JsonResponse({"error": f"scope is one of {', '.join(MetricSample.Scope.values)}"}, status=400)
    span = request.GET.get("range", "1h")
    if span not in RANGES:
        return JsonResponse({"error": f"range is one of {', '.join(RANGES)}"}, status=400)
    seconds = RANGES[span]
    object_id: int | None = None
    model: str | None = None
    if scope != MetricSample.Scope.FLEET:
        text = request.GET.get("id", "")
        if not text.isdigit() or len(text) > 18:
            return JsonResponse({"error": f"a {scope}'s chart needs its id (digits)"}, status=400)
        object_id = int(text)
        if scope == MetricSample.Scope.PIPELINE:
            model = get_object_or_404(Pipeline, pk=object_id).name
        else:
            get_object_or_404(Node, pk=object_id)
    prometheus = env_str("FLOTILLA_PROMETHEUS_URL")
    if prometheus and scope != MetricSample.Scope.NODE:
        end = time.time()
        try:
            data = PrometheusReader(prometheus).history(model, end - seconds, end, _STEPS[seconds])
        except PrometheusError as exc:
            return JsonResponse({"error": str(exc)}, status=502)
        return JsonResponse(data)
    return JsonResponse(sample_history(scope, object_id, seconds))
