"""Who may do what in the dashboard: the people's roles of controlplane.accounts, as the API checks them.

Pages need a login; changing anything needs operator (``User.has_role``, the check the API's
RolePermission makes); reading the audit log needs operator too, as in the API. Anonymous visitors are
sent to the login page; a person whose role is too low gets 403.
"""

from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar, cast

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponseBase

from controlplane.accounts.models import Role, User

View = TypeVar("View", bound=Callable[..., HttpResponseBase])

# What acting (deploy, scale, stop, start, restart, drain, add a model) needs, in the API and here.
ACT_ROLE = Role.OPERATOR
AUDIT_ROLE = Role.OPERATOR


def has_role(request: HttpRequest, role: Role) -> bool:
    """Whether the logged-in person has ``role`` or a higher one."""
    user = request.user
    return isinstance(user, User) and user.has_role(role)


def can_act(request: HttpRequest) -> bool:
    return has_role(request, ACT_ROLE)


def role_required(role: Role) -> Callable[[View], View]:
    """A view for people logged in with ``role`` or above; others get 403 (anonymous: the login page)."""

    def decorate(view: View) -> View:
        @wraps(view)
        def checked(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
            if not has_role(request, role):
                raise PermissionDenied(f"this needs the {role.label} role")
            return view(request, *args, **kwargs)

        return cast(View, login_required(checked))

    return decorate
