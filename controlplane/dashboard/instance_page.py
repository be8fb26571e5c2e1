"""One instance's page: its placement decision and why, its timeline, its replica's restart history, its
engine settings, its load, and its log followed live with a filter.

The state, placement, timeline and restarts are one partial (``partials/instance_detail.html``), which the
instance's socket (controlplane/live/consumers.py ``InstanceConsumer``) renders again when the instance
changes; the load is the bridge's, forwarded to the page as the pipeline page gets it. Every role may read it.
"""

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404
from django.views.decorators.http import require_GET

from controlplane.dashboard.instance_detail import detail_context, engine_settings, instance_for_page
from controlplane.dashboard.views import render_page


@login_required
@require_GET
def instance_page(request: HttpRequest, pk: int) -> HttpResponse:
    """One instance (404 for an unknown one); read-only: its controls stay on the pipeline page."""
    instance = get_object_or_404(instance_for_page(), pk=pk)
    context = detail_context(instance) | {"settings": engine_settings(instance)}
    return render_page(request, "dashboard/instance.html", context)
