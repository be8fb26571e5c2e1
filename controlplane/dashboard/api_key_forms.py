"""The API keys and Usage pages' forms: a new key (checked as the REST API checks one, then made by
``controlplane.apikeys.actions.create_key``) and the usage filters."""

import datetime
import re
from typing import Any

from django import forms
from django.utils import timezone

from controlplane.accounts.models import User
from controlplane.apikeys import actions
from controlplane.apikeys.api.serializers import MAX_BUDGET, MAX_LIMIT, MAX_MODELS_PER_KEY
from controlplane.apikeys.models import ApiKey
from controlplane.audit.records import Actor
from controlplane.dashboard.forms import ActionForm
from controlplane.deployments.models import Pipeline, validate_served_name
from controlplane.errors import Conflict, Invalid

# How far back the Usage page looks when it is opened without filters.
DEFAULT_USAGE_DAYS = 30
# Typed model names are separated by commas, spaces or new lines (a served name has none of them).
_SEPARATORS = re.compile(r"[\s,]+")


def served_names() -> list[str]:
    """The pipelines' served names, for the key form's checkboxes."""
    return sorted(Pipeline.objects.values_list("name", flat=True))


class ApiKeyForm(ActionForm):
    """A new key for the OpenAI endpoint: a name, the models it may use (none ticked or typed: every one),
    an expiry and optional limits; ``owner`` only in an admin's form."""

    conflict_field = "name"
    field_order = (
        "name", "owner", "models", "other_models", "expires_at", "requests_per_minute", "tokens_per_minute",
        "monthly_token_budget", "max_concurrent_requests",
    )  # fmt: skip

    name = forms.CharField(max_length=100, help_text="What the key is for, e.g. the application's name.")
    models = forms.MultipleChoiceField(
        label="Allowed models",
        required=False,
        widget=forms.CheckboxSelectMultiple,
        help_text="None ticked or typed: every model, now and later.",
    )
    other_models = forms.CharField(
        label="Other model names",
        required=False,
        max_length=4000,
        help_text="Served names not deployed yet, separated by commas or spaces.",
    )
    expires_at = forms.DateTimeField(
        label="Expires (UTC)",
        required=False,
        # The format a datetime-local input shows (Django's default, with a space, it would leave empty).
        widget=forms.DateTimeInput(attrs={"type": "datetime-local"}, format="%Y-%m-%dT%H:%M"),
        help_text="Empty: never.",
    )
    requests_per_minute = forms.IntegerField(
        min_value=1, max_value=MAX_LIMIT, required=False, help_text="Empty: no limit."
    )
    tokens_per_minute = forms.IntegerField(
        min_value=1, max_value=MAX_LIMIT, required=False, help_text="Prompt and completion tokens; empty: no limit."
    )
    monthly_token_budget = forms.IntegerField(
        min_value=1, max_value=MAX_BUDGET, required=False, help_text="Tokens per calendar month (UTC); empty: none."
    )
    max_concurrent_requests = forms.IntegerField(
        label="Concurrent requests",
        min_value=1,
        max_value=MAX_LIMIT,
        required=False,
        help_text="Served at once by each ingress process; empty: the ingress's default (no cap unless set).",
    )

    def __init__(self, *args: Any, admin: bool, person: User, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.person = person
        self.fields["models"].choices = [(name, name) for name in served_names()]
        if admin:
            self.fields["owner"] = forms.ModelChoiceField(
                queryset=User.objects.filter(is_active=True).order_by("username"),
                to_field_name="username",
                initial=person.username,
                empty_label=None,
                help_text="Who the key belongs to (their usage, their key to revoke).",
            )
            self.order_fields(self.field_order)

    def clean_name(self) -> str:
        name: str = self.cleaned_data["name"].strip()
        if not name:
            raise forms.ValidationError("A key needs a name.")
        return name

    def clean_other_models(self) -> list[str]:
        names = [name for name in _SEPARATORS.split(self.cleaned_data["other_models"]) if name]
        for name in names:
            try:
                validate_served_name(name)
            except forms.ValidationError as exc:
                raise forms.ValidationError(f"{name[:60]!r}: {' '.join(exc.messages)}.") from exc
        return names

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        allowed = {*cleaned.get("models", ()), *cleaned.get("other_models", ())}
        if len(allowed) > MAX_MODELS_PER_KEY:
            self.add_error("other_models", f"At most {MAX_MODELS_PER_KEY} models per key.")
        cleaned["allowed_models"] = sorted(allowed)
        return cleaned

    def submit(self, actor: Actor) -> tuple[ApiKey, str] | None:
        """Make the key; returns it and its secret (to show once), or None when refused (the errors are on
        the form)."""
        if not self.is_valid():
            return None
        data = self.cleaned_data
        try:
            return actions.create_key(
                actor,
                data.get("owner") or self.person,
                data["name"],
                allowed_models=data["allowed_models"],
                expires_at=data["expires_at"],
                requests_per_minute=data["requests_per_minute"],
                tokens_per_minute=data["tokens_per_minute"],
                monthly_token_budget=data["monthly_token_budget"],
                max_concurrent_requests=data["max_concurrent_requests"],
            )
        except (Invalid, Conflict) as error:
            self.refuse(error)
            return None


class UsageFilterForm(forms.Form):
    """The Usage page's filters, the same as ``/api/v1/usage/``'s; every one optional, and they combine."""

    key = forms.TypedChoiceField(coerce=int, required=False, empty_value=None)
    model = forms.CharField(
        max_length=200,
        required=False,
        widget=forms.TextInput(attrs={"list": "models-seen", "placeholder": "every model"}),
        help_text="a served model's name",
    )
    since = forms.DateField(required=False, label="Since (UTC)", widget=forms.DateInput(attrs={"type": "date"}))
    until = forms.DateField(required=False, label="Until (UTC)", widget=forms.DateInput(attrs={"type": "date"}))

    def __init__(self, *args: Any, keys: list[ApiKey], show_owner: bool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)

        def label(key: ApiKey) -> str:
            owner = f", {key.owner.username}" if show_owner else ""
            return f"{key.name} ({key.key_start}…{owner}{', revoked' if key.revoked else ''})"

        self.fields["key"].choices = [("", "every key"), *((key.pk, label(key)) for key in keys)]

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        since, until = cleaned.get("since"), cleaned.get("until")
        if since and until and since > until:
            self.add_error("until", "Until is before since.")
        return cleaned


def default_usage_filters(today: datetime.date | None = None) -> dict[str, str]:
    """What the Usage page shows when opened without filters: the last ``DEFAULT_USAGE_DAYS`` days."""
    today = today or timezone.now().date()
    return {"since": (today - datetime.timedelta(days=DEFAULT_USAGE_DAYS - 1)).isoformat()}
