"""People and tokens in the Django admin, for people with the admin role (controlplane/readonly_admin.py).

Every save, deletion and password change here goes through controlplane/accounts/actions.py, so it has its
audit entry like the same change made through the API or ``manage.py createtoken``. Tokens are listed and
revoked here; they are created with the API or ``manage.py createtoken`` (the key is shown once).
"""

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from django.contrib import admin
from django.contrib.auth.admin import UserAdmin
from django.contrib.auth.forms import AdminPasswordChangeForm, UserChangeForm
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse

from controlplane.accounts import actions
from controlplane.accounts.forms import ThrottledAdminLogin
from controlplane.accounts.models import ApiToken, Role, User
from controlplane.audit.records import Actor
from controlplane.readonly_admin import ForAdmins, is_admin

# Who is changing a password in the admin: Django builds the password form without the request.
_acting: ContextVar[Actor] = ContextVar("acting")


@contextmanager
def _acting_as(request: HttpRequest) -> Iterator[None]:
    token = _acting.set(Actor.person(request.user))
    try:
        yield
    finally:
        _acting.reset(token)


class AuditedPasswordChange(AdminPasswordChangeForm):
    """The admin's form that sets another person's password, saving it through ``actions.set_password``."""

    def save(self, commit: bool = True) -> Any:
        password = self.cleaned_data["password1"] if self.cleaned_data.get("set_usable_password", True) else None
        return actions.set_password(_acting.get(), self.user, password)


class PersonChangeForm(UserChangeForm):  # type: ignore[type-arg]
    """The admin's form for a person, which says so when a change would leave no active admin (the action
    refuses it anyway: this makes it an error on the form rather than a failed request)."""

    def clean(self) -> dict[str, Any]:
        cleaned: dict[str, Any] = super().clean()
        old = self.instance
        superuser = cleaned.get("is_superuser", old.is_superuser)  # read-only, so absent, for non-superusers
        stays_admin = cleaned.get("is_active", False) and (cleaned.get("role") == Role.ADMIN or superuser)
        if old.pk and not stays_admin and actions.is_last_active_admin(old):
            raise ValidationError(
                f"{old.username} is the only active admin: make another person an admin first.", code="last_admin"
            )
        return cleaned


@admin.register(User)
class FlotillaUserAdmin(ForAdmins, UserAdmin):  # type: ignore[misc]
    list_display = ("username", "role", "is_active", "is_superuser", "last_login")
    list_filter = ("role", "is_active", "is_superuser")
    # Roles say what a person may do; Django's groups and permissions are not used, and is_staff follows the role.
    fieldsets = (
        (None, {"fields": ("username", "password")}),
        ("Personal info", {"fields": ("first_name", "last_name", "email")}),
        ("Flotilla", {"fields": ("role", "is_active", "is_superuser")}),
        ("Dates", {"fields": ("last_login", "date_joined")}),
    )
    add_fieldsets = (
        (None, {"classes": ("wide",), "fields": ("username", "role", "usable_password", "password1", "password2")}),
    )
    readonly_fields = ("last_login", "date_joined")
    filter_horizontal = ()
    change_password_form = AuditedPasswordChange
    form = PersonChangeForm

    def has_add_permission(self, request: HttpRequest) -> bool:
        return is_admin(request)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return is_admin(request)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return is_admin(request) and obj != request.user  # not oneself: the last admin could lock everyone out

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        # Only a superuser makes superusers (an admin could otherwise make a peer one that no role change demotes).
        user = request.user
        superuser = isinstance(user, User) and user.is_superuser
        return self.readonly_fields if superuser else (*self.readonly_fields, "is_superuser")

    def save_model(self, request: HttpRequest, obj: User, form: Any, change: bool) -> None:
        actions.save_user(Actor.person(request.user), obj)

    def delete_model(self, request: HttpRequest, obj: User) -> None:
        actions.delete_user(Actor.person(request.user), obj)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[User]) -> None:
        for user in queryset:
            actions.delete_user(Actor.person(request.user), user)

    def user_change_password(self, request: HttpRequest, id: str, form_url: str = "") -> HttpResponse:
        with _acting_as(request), transaction.atomic():
            return super().user_change_password(request, id, form_url)  # type: ignore[no-any-return]


@admin.register(ApiToken)
class ApiTokenAdmin(ForAdmins):
    """Tokens are listed and revoked (deleted) here, through ``actions.revoke_token``; nothing else changes."""

    list_display = (
        "key_start", "kind", "user", "node_name", "description", "scope", "created_at", "expires_at", "last_used_at",
    )  # fmt: skip
    list_filter = ("kind", "scope")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return is_admin(request)

    def delete_model(self, request: HttpRequest, obj: ApiToken) -> None:
        actions.revoke_token(Actor.person(request.user), obj)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[ApiToken]) -> None:
        for token in queryset:
            actions.revoke_token(Actor.person(request.user), token)


# The admin's login counts failed logins with the dashboard's (controlplane/accounts/throttle.py).
admin.site.login_form = ThrottledAdminLogin
