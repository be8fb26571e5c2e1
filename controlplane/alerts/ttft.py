"""A pipeline's recent time to first token (p95), the one figure the TTFT rule reads.

It comes from the control plane's own metric history (controlplane/traffic: the bridge writes a
``MetricSample`` per pipeline every window from the gateways' request records): the p95 of the samples of the
last ``FLOTILLA_ALERT_TTFT_WINDOW_S`` seconds (default 60) that counted requests, weighted by their requests.
A p95 cannot be merged exactly from windows' p95s; the weighted mean is what a minute of 10-second windows
allows, and it moves with the slow windows as an alert should. None when no request came in that time (no
figure: no alert), or no bridge writes samples.
"""

import datetime

from django.db.models import F, FloatField, Sum
from django.db.models.functions import Cast
from django.utils import timezone

from controlplane.deployments.models import Pipeline
from controlplane.traffic.models import MetricSample
from runtime.config import env_float

#: How far back the rule looks, seconds.
WINDOW_S_SETTING = "FLOTILLA_ALERT_TTFT_WINDOW_S"
DEFAULT_WINDOW_S = 60.0


def recent_ttft_p95(pipeline: Pipeline, now: datetime.datetime | None = None) -> float | None:
    """``pipeline``'s TTFT p95 in milliseconds over the last window (see the module), or None."""
    window_s = env_float(WINDOW_S_SETTING, DEFAULT_WINDOW_S, minimum=1.0)
    since = (now or timezone.now()) - datetime.timedelta(seconds=window_s)
    totals = MetricSample.objects.filter(
        scope=MetricSample.Scope.PIPELINE,
        pipeline=pipeline,
        at__gt=since,
        requests__gt=0,
        ttft_p95_s__isnull=False,
    ).aggregate(
        weighted=Sum(F("ttft_p95_s") * Cast("requests", FloatField())),
        requests=Sum("requests"),
    )
    if not totals["requests"]:
        return None
    return float(totals["weighted"]) / float(totals["requests"]) * 1000.0
