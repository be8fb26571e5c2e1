"""The Alerts page: what fires now (marked when a silence holds its notifications), what resolved lately, the
silences; operators and admins silence an alert and expire a silence (read-only people see no such controls,
and get 403 if they post). The nav's count of firing alerts refreshes itself every ``BADGE_EVERY_S``."""

import datetime
from typing import Any

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.shortcuts import get_object_or_404, redirect
from django.template.loader import render_to_string
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from controlplane.alerts import actions
from controlplane.alerts.models import Alert, Rule, Silence
from controlplane.alerts.notify import active_silences, silenced_by
from controlplane.audit.records import Actor
from controlplane.dashboard.access import ACT_ROLE, can_act, role_required
from controlplane.dashboard.alert_counts import BADGE_EVERY_S, firing_count
from controlplane.dashboard.forms import ActionForm
from controlplane.dashboard.views import render_page
from controlplane.errors import Conflict, Invalid

RECENT_RESOLVED = 20
#: Seconds between the page's refreshes of its tables (the rules run every FLOTILLA_ALERT_EVERY_S, 15 s).
REFRESH_S = 5
DURATIONS = [(60, "1 hour"), (240, "4 hours"), (1440, "1 day"), (10080, "1 week")]


class SilenceForm(ActionForm):
    """A silence of a rule and/or a subject, for a while, with a reason."""

    rule = forms.ChoiceField(choices=[("", "any rule"), *Rule.choices], required=False)
    subject = forms.CharField(max_length=255, required=False, help_text="An alert's subject; empty: any.")
    duration_minutes = forms.TypedChoiceField(choices=DURATIONS, coerce=int, initial=60, label="For")
    comment = forms.CharField(max_length=2000, label="Why")

    def submit(self, actor: Actor) -> Silence | None:
        """The silence made; None when the input or the action refused (the errors are on the form)."""
        if not self.is_valid():
            return None
        data = self.cleaned_data
        now = timezone.now()
        try:
            return actions.create_silence(
                actor,
                rule=data["rule"],
                subject=data["subject"],
                ends_at=now + datetime.timedelta(minutes=data["duration_minutes"]),
                comment=data["comment"],
                now=now,
            )
        except Invalid as error:
            self.refuse(error)
            return None


def render_badge() -> str:
    """``<span id="alerts-badge">``: the count of firing alerts, refreshing itself."""
    return render_to_string("dashboard/partials/alerts_badge.html", {"count": firing_count(), "every_s": BADGE_EVERY_S})


@login_required
@require_GET
def alerts_badge(request: HttpRequest) -> HttpResponse:
    return HttpResponse(render_badge())


def render_summary() -> str:
    """``<p id="overview-alerts">``: the Overview's line of firing alerts, refreshing itself as the badge does."""
    return render_to_string(
        "dashboard/partials/overview_alerts.html", {"count": firing_count(), "every_s": BADGE_EVERY_S}
    )


@login_required
@require_GET
def alerts_summary(request: HttpRequest) -> HttpResponse:
    return HttpResponse(render_summary())


@login_required
@require_GET
def alerts_page(request: HttpRequest) -> HttpResponse:
    return _page(request, SilenceForm())


def _page(request: HttpRequest, form: SilenceForm, *, status: int = 200) -> HttpResponse:
    now = timezone.now()
    silences = active_silences(now)
    firing = [(alert, silenced_by(alert, silences)) for alert in Alert.objects.filter(resolved_at=None)]
    resolved = Alert.objects.exclude(resolved_at=None).order_by("-resolved_at")[:RECENT_RESOLVED]
    context: dict[str, Any] = {
        "firing": firing,
        "resolved": resolved,
        "silences": silences,
        "form": form,
        "durations": DURATIONS,
        "can_silence": can_act(request),
        "refresh_s": REFRESH_S,
    }
    if request.headers.get("HX-Request") and request.method == "GET":  # the tables' own refresh
        return render_page(request, "dashboard/partials/alerts_tables.html", context, status=status)
    return render_page(request, "dashboard/alerts.html", context, status=status)


@role_required(ACT_ROLE)
@require_POST
def silence_create(request: HttpRequest) -> HttpResponseBase:
    """Make a silence from the page's form (or an alert's Silence button); refused input: the page, 400."""
    form = SilenceForm(request.POST)
    silence = form.submit(Actor.person(request.user))
    if silence is None:
        return _page(request, form, status=400)
    messages.success(request, f"Silenced until {silence.ends_at:%Y-%m-%d %H:%M} UTC: {silence}.")
    return redirect("dashboard:alerts")


@role_required(ACT_ROLE)
@require_POST
def silence_expire(request: HttpRequest, pk: int) -> HttpResponseBase:
    """End a silence now: its alerts are notified again from the next pass."""
    silence = get_object_or_404(Silence, pk=pk)
    try:
        actions.expire_silence(Actor.person(request.user), silence)
    except Conflict as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, "The silence has ended: its alerts are notified again from the next pass.")
    return redirect("dashboard:alerts")
