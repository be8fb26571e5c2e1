"""The People and Account pages' forms: they check the input's shape; the accounts actions check the rest
(the password validators, the last admin) and their refusals land on the field they name."""

import datetime

from django import forms
from django.contrib.auth.validators import UnicodeUsernameValidator
from django.utils import timezone

from controlplane.accounts import actions
from controlplane.accounts.models import ApiToken, Role, User
from controlplane.audit.records import Actor
from controlplane.dashboard.forms import ActionForm
from controlplane.errors import Conflict, Invalid


class PersonDetails(forms.Form):
    """What an admin may change of a person: their role, names and email."""

    role = forms.ChoiceField(choices=Role.choices)
    first_name = forms.CharField(max_length=150, required=False)
    last_name = forms.CharField(max_length=150, required=False)
    email = forms.EmailField(required=False)


class NewPersonForm(PersonDetails, ActionForm):
    """Add a person; unless "can log in" is unticked, they get a generated password, shown once."""

    conflict_field = "username"
    field_order = ("username", "role", "first_name", "last_name", "email", "can_log_in")

    username = forms.CharField(
        max_length=150,
        validators=[UnicodeUsernameValidator()],
        help_text="Letters, digits and @ . + - _ only: what they log in with.",
    )
    can_log_in = forms.BooleanField(
        required=False,
        initial=True,
        label="Can log in",
        help_text="Ticked: a generated password, shown once here. Unticked: tokens only.",
    )

    def submit(self, actor: Actor) -> tuple[User, str | None] | None:
        """Add the person; returns them and their password (None: tokens only), or None when refused (the
        errors are on the form)."""
        if not self.is_valid():
            return None
        data = dict(self.cleaned_data)
        password = actions.generate_password() if data.pop("can_log_in") else None
        try:
            person = actions.create_user(actor, data.pop("username"), Role(data.pop("role")), password=password, **data)
        except (Invalid, Conflict) as error:
            self.refuse(error)
            return None
        return person, password


class OwnTokenForm(ActionForm):
    """A REST API token for oneself (what ``POST /api/v1/tokens/`` makes for a person): acting as oneself, with
    one's role, or only reading; its key is shown once, in the answer."""

    description = forms.CharField(max_length=200, required=False, help_text="What uses it: a script, a host.")
    scope = forms.ChoiceField(choices=ApiToken.Scope.choices, initial=ApiToken.Scope.FULL)
    expires_in_days = forms.IntegerField(
        min_value=1, max_value=3650, required=False, label="Expires in (days)", help_text="Empty: never."
    )

    def submit(self, actor: Actor, person: User) -> tuple[ApiToken, str] | None:
        """Make the token; returns it and its key, or None when refused (the errors are on the form)."""
        if not self.is_valid():
            return None
        days = self.cleaned_data["expires_in_days"]
        expires_at = None if days is None else timezone.now() + datetime.timedelta(days=days)
        try:
            return actions.create_person_token(
                actor,
                person,
                self.cleaned_data["description"],
                scope=ApiToken.Scope(self.cleaned_data["scope"]),
                expires_at=expires_at,
            )
        except Invalid as error:
            self.refuse(error)
            return None


class PasswordChange(ActionForm):
    """A person's change of their own password: the current one, and the new one twice."""

    old_password = forms.CharField(
        label="Current password", strip=False, widget=forms.PasswordInput(attrs={"autocomplete": "current-password"})
    )
    new_password = forms.CharField(
        label="New password", strip=False, widget=forms.PasswordInput(attrs={"autocomplete": "new-password"})
    )
    new_password_again = forms.CharField(
        label="New password again", strip=False, widget=forms.PasswordInput(attrs={"autocomplete": "new-password"})
    )

    def clean(self) -> dict[str, object]:
        cleaned = super().clean() or {}
        if cleaned.get("new_password") and cleaned.get("new_password") != cleaned.get("new_password_again"):
            self.add_error("new_password_again", "The two new passwords differ.")
        return cleaned

    def submit(self, actor: Actor, person: User, address: str) -> bool:
        """Change the password; False when refused (the errors are on the form)."""
        if not self.is_valid():
            return False
        try:
            actions.change_password(
                actor, person, self.cleaned_data["old_password"], self.cleaned_data["new_password"], address=address
            )
        except Invalid as error:
            self.refuse(error)
            return False
        return True
