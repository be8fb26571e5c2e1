"""The Playground page: chat with a served model from the browser, through the gateway's OpenAI endpoint.

The page only says what to talk to: the running pipelines' served names and the gateway's base URL
(``FLOTILLA_GATEWAY_URL``). The browser sends the chat itself (static/dashboard/playground.js) straight to
the gateway with an API key the person pastes: the control plane keeps only keys' hashes, so it has none to
lend, and a pasted key stays in the page's memory (never posted here, never stored).
"""

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_GET

from controlplane.dashboard import gateway, views
from controlplane.deployments.models import Pipeline
from runtime.errors import ConfigError

# The sampling settings the form starts with (OpenAI's defaults but a shorter answer, for a quick try).
DEFAULTS = {"temperature": 0.7, "top_p": 1.0, "max_tokens": 256}


def served_names() -> list[str]:
    """The served names of the running pipelines, the models the gateway may route to, by name."""
    return list(Pipeline.objects.filter(state=Pipeline.State.RUNNING).order_by("name").values_list("name", flat=True))


@login_required
@require_GET
def playground_page(request: HttpRequest) -> HttpResponse:
    """The chat form, for every role: sending goes through the gateway with the person's own key."""
    problem = None
    try:
        url = gateway.gateway_url()
    except ConfigError as exc:
        url, problem = None, str(exc)
    context = {"models": served_names(), "gateway_url": url, "problem": problem, "defaults": DEFAULTS}
    return views.render_page(request, "dashboard/playground.html", context)
