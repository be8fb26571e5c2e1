"""The login forms of the dashboard and the admin, with login throttling (controlplane/accounts/throttle.py)."""

from typing import Any

from django import forms
from django.contrib.admin.forms import AdminAuthenticationForm
from django.contrib.auth.forms import AuthenticationForm

from controlplane.accounts import throttle


class ThrottledLogin(AuthenticationForm):
    """A login form that refuses, before checking the password, a user name and address with too many
    recent failures, saying how long to wait; ``retry_after_s`` is then set (else None)."""

    retry_after_s: int | None = None

    def clean(self) -> dict[str, Any]:
        username = self.cleaned_data.get("username") or ""
        address = throttle.client_address(self.request)
        wait = throttle.wait_s(username, address)
        if wait:
            self.retry_after_s = wait
            raise forms.ValidationError(
                "Too many failed attempts for this user name: try again in %(wait)d s.",
                code="throttled",
                params={"wait": wait},
            )
        try:
            cleaned = super().clean()
        except forms.ValidationError:
            if username:
                throttle.failed(username, address)
            raise
        throttle.succeeded(username, address)
        return cleaned


class ThrottledAdminLogin(ThrottledLogin, AdminAuthenticationForm):
    """The admin's login form (staff only), throttled the same way and counted with the dashboard's."""
