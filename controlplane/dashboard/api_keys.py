"""The API keys page (operators: their own keys; admins: everyone's) and the Usage page (what those keys
used, per key, model and UTC day, in charts and a table, with the CSV of ``/api/v1/usage/export/``).

A key is made and revoked through ``controlplane.apikeys.actions`` (audited, published to every ingress
through etcd). A new key's secret is shown once, in the answer to the form's POST, and never stored in the
session; the Revoke button is an htmx POST answered with the key's fresh row and a note, as the People
page's buttons are.
"""

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from django.contrib import messages
from django.core.paginator import Paginator
from django.db.models import F, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.shortcuts import get_object_or_404, redirect
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from controlplane.accounts.models import Role, User
from controlplane.apikeys import actions
from controlplane.apikeys.models import ApiKey, KeyUsage
from controlplane.audit.records import Actor
from controlplane.dashboard import gateway
from controlplane.dashboard.access import role_required
from controlplane.dashboard.api_key_forms import ApiKeyForm, UsageFilterForm, default_usage_filters
from controlplane.dashboard.usage import charts, day_range, totals, usage_rows, visible_keys
from controlplane.dashboard.views import render_page
from controlplane.errors import Conflict
from runtime.errors import ConfigError

# As in the REST API: operators manage and read their own keys, admins everyone's; read-only people neither.
KEYS_ROLE = Role.OPERATOR
USAGE_PAGE_SIZE = 100
# What a snippet names when FLOTILLA_GATEWAY_URL is not set: the reader puts their gateway's address there.
GATEWAY_PLACEHOLDER = "http://GATEWAY-HOST:8080"


@dataclass(frozen=True)
class NewKey:
    """A key just made, with its secret and how to call the endpoint with it (shown once)."""

    key: ApiKey
    secret: str
    curl: str
    python: str


def snippets(secret: str, base_url: str, model: str) -> tuple[str, str]:
    """A curl command and an openai-client program that call ``base_url``'s chat completions with ``secret``."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}]})
    curl = (
        f"curl {base_url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f'  -H "Authorization: Bearer {secret}" \\\n'
        f"  -d '{body}'"
    )
    python = (
        "from openai import OpenAI\n\n"
        f'client = OpenAI(base_url="{base_url}/v1", api_key="{secret}")\n'
        "reply = client.chat.completions.create(\n"
        f'    model="{model}", messages=[{{"role": "user", "content": "Hello!"}}]\n'
        ")\n"
        "print(reply.choices[0].message.content)"
    )
    return curl, python


def _gateway_base() -> str:
    try:
        return gateway.gateway_url() or GATEWAY_PLACEHOLDER
    except ConfigError:
        return GATEWAY_PLACEHOLDER


def _new_key(key: ApiKey, secret: str, served: list[str]) -> NewKey:
    model = (key.allowed_models or served or ["MODEL"])[0]
    curl, python = snippets(secret, _gateway_base(), model)
    return NewKey(key, secret, curl, python)


def key_rows(person: User) -> QuerySet[ApiKey]:
    """The keys ``person`` manages: live ones first, newest first."""
    return visible_keys(person).order_by(F("revoked_at").asc(nulls_first=True), "-created_at", "-id")


def _person(request: HttpRequest) -> User:
    user = request.user
    assert isinstance(user, User)  # role_required let only people through
    return user


@role_required(KEYS_ROLE)
@require_http_methods(["GET", "POST"])
def api_keys_page(request: HttpRequest) -> HttpResponse:
    """The person's keys (an admin's: everyone's) and the new-key form, whose answer shows the key once."""
    person = _person(request)
    admin = person.has_role(Role.ADMIN)
    form = ApiKeyForm(admin=admin, person=person)
    created: NewKey | None = None
    status = 200
    if request.method == "POST":
        form = ApiKeyForm(request.POST, admin=admin, person=person)
        made = form.submit(Actor.person(person))
        if made is None:
            status = 400
        else:
            created = _new_key(*made, served=[name for name, _ in form.fields["models"].choices])
            form = ApiKeyForm(admin=admin, person=person)
    return _keys_page(request, person, form=form, created=created, status=status)


def _keys_page(
    request: HttpRequest,
    person: User,
    *,
    form: ApiKeyForm | None = None,
    created: NewKey | None = None,
    note: tuple[str, bool] | None = None,
    status: int = 200,
) -> HttpResponse:
    admin = person.has_role(Role.ADMIN)
    context = {
        "keys": key_rows(person),
        "form": form or ApiKeyForm(admin=admin, person=person),
        "created": created,
        "show_owner": admin,
        "note": note,
        "now": timezone.now(),
    }
    return render_page(request, "dashboard/api_keys.html", context, status=status)


@role_required(KEYS_ROLE)
@require_POST
def api_key_revoke(request: HttpRequest, pk: int) -> HttpResponseBase:
    """Revoke one of the person's keys (an admin: anyone's; another's is a 404); answered with its row."""
    person = _person(request)
    key = get_object_or_404(visible_keys(person), pk=pk)
    try:
        actions.revoke_key(Actor.person(person), key)
    except Conflict as exc:
        return _key_answer(request, person, key.pk, str(exc), status=409)
    done = f"Key {key.name} ({key.key_start}…) is revoked: every ingress refuses it within a second."
    return _key_answer(request, person, key.pk, done)


def _key_answer(request: HttpRequest, person: User, pk: int, note: str, *, status: int = 200) -> HttpResponseBase:
    """The key's fresh row and ``note`` in the flash area; without htmx, back to the page with the note."""
    ok = status < 400
    if not request.headers.get("HX-Request"):
        (messages.success if ok else messages.error)(request, note)
        return redirect("dashboard:api-keys")
    context = {"key": key_rows(person).get(pk=pk), "show_owner": person.has_role(Role.ADMIN), "now": timezone.now()}
    html = render_to_string("dashboard/partials/api_key.html", context, request=request)
    flash = render_to_string("dashboard/partials/flash.html", {"notes": [(note, ok)], "out_of_band": True})
    return HttpResponse(html + flash, status=status)


@role_required(KEYS_ROLE)
@require_GET
def usage_page(request: HttpRequest) -> HttpResponse:
    """Usage of the person's keys (an admin's: every key's) per day, by key and by model, filtered."""
    person = _person(request)
    admin = person.has_role(Role.ADMIN)
    keys = list(visible_keys(person))
    params = request.GET.copy()
    page_number = params.pop("page", [None])[-1]
    if not params:
        params.update(default_usage_filters())
    form = UsageFilterForm(params, keys=keys, show_owner=admin)
    context: dict[str, Any] = {"form": form, "show_owner": admin, "has_keys": bool(keys)}
    if not form.is_valid():
        return render_page(request, "dashboard/usage.html", context, status=400)
    filters = {name: value for name, value in form.cleaned_data.items() if value not in (None, "")}
    rows = usage_rows(person, **filters)
    today = timezone.now().date()
    days = day_range(rows, filters.get("since"), filters.get("until"), today)
    labels = {key.pk: f"{key.name} ({key.key_start}…)" for key in keys}
    query = urlencode({name: str(value) for name, value in filters.items()})
    context |= {
        "filtered": True,
        "narrowed": "key" in filters or "model" in filters,
        "page": Paginator(rows, USAGE_PAGE_SIZE).get_page(page_number),
        "totals": totals(rows),
        "charts": charts(rows, days, labels),
        "query": query,
        "csv_url": reverse("usage-export") + (f"?{query}" if query else ""),
        "models_seen": _models_seen(person),
    }
    return render_page(request, "dashboard/usage.html", context)


def _models_seen(person: User) -> list[str]:
    """The models the person's keys used, for the model filter's suggestions."""
    rows = KeyUsage.objects.filter(key__in=visible_keys(person)).order_by("model")
    return list(rows.values_list("model", flat=True).distinct()[:500])
