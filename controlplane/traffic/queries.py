"""Reads of the request log for the dashboard's pages."""

from controlplane.traffic.models import RequestRecord

#: The router view's rows: a pipeline's last requests.
ROUTER_VIEW_ROWS = 50


def router_view(pipeline_id: int) -> list[RequestRecord]:
    """A pipeline's last requests, newest first, for its page's router view: which worker each went to, its
    overlap and cost."""
    return list(
        RequestRecord.objects.filter(pipeline_id=pipeline_id)
        .select_related("instance")
        .order_by("-at", "-pk")[:ROUTER_VIEW_ROWS]
    )
