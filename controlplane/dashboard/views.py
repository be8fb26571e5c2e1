"""The dashboard's pages: server-rendered, for people who are logged in."""

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from controlplane.dashboard.overview import overview


@login_required
def overview_page(request: HttpRequest) -> HttpResponse:
    """Nodes and GPUs, pipelines with ready/desired replicas, and the latest audit events."""
    return render(request, "dashboard/overview.html", {"overview": overview()})
