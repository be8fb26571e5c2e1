"""The banner on every page when the fleet is not being looked after: the reconciler is late or Redis
does not answer. Each problem says what follows from it and what to check next.

Pages render it (``{% health_banner %}`` in base.html) and it asks for itself again every
``REFRESH_S`` seconds (htmx), so it appears and clears without a reload.
"""

from dataclasses import dataclass

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.template.loader import render_to_string
from django.views.decorators.http import require_GET

from controlplane.health.checks import BrokerCheck, ReconcilerCheck, check_broker, check_reconciler

REFRESH_S = 15
_WORKER_HINT = (
    "Check the reconciler's Celery worker and beat: under `flotilla up`, the celery lines of its output; "
    "under systemd, `systemctl status flotilla-celery-worker flotilla-celery-beat` and "
    "`journalctl -u flotilla-celery-worker`"
)


@dataclass(frozen=True)
class Banner:
    problems: list[str]


def problems(broker: BrokerCheck, reconciler: ReconcilerCheck) -> list[str]:
    """What is wrong, in words for an operator (empty when nothing is)."""
    found = []
    if not reconciler.ok:
        if reconciler.age_s is not None:
            what = f"The reconciler has not run for {_duration(reconciler.age_s)}"
        elif reconciler.last_pass_at is None and "never" in reconciler.error:
            what = "The reconciler has never finished a pass"
        else:
            what = f"The reconciler's state is unknown ({reconciler.error})"
        found.append(
            f"{what}: nothing is being restarted or placed, and no start or stop reaches an agent. "
            f"{_WORKER_HINT}; and Redis at {broker.url or 'FLOTILLA_BROKER_URL'}."
        )
    if not broker.ok:
        found.append(
            f"{broker.error}: no task reaches an agent and the reconciler cannot run. Check that redis-server "
            "runs (`systemctl status redis-server`; `redis-cli -u URL ping` answers PONG) and that "
            "FLOTILLA_BROKER_URL names it."
        )
    return found


def render_banner() -> str:
    """``<div id="health-banner">``: the problems (or nothing), refreshing itself."""
    found = problems(check_broker(), check_reconciler())
    return render_to_string("dashboard/partials/health_banner.html", {"problems": found, "refresh_s": REFRESH_S})


@login_required
@require_GET
def health_banner(request: HttpRequest) -> HttpResponse:
    """The banner alone, for its own refresh."""
    return HttpResponse(render_banner())


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} minutes"
    return f"{seconds / 3600:.0f} hours"
