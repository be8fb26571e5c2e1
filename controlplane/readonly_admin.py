"""The Django admin of the control plane: for people with the admin role, and changing nothing itself.

Roles are a field (controlplane/accounts/models.py), not Django's per-model permissions, so an admin who is
not a superuser (the ``admin`` account ``flotilla up`` creates) holds no permission Django's admin looks for,
and saw "You don't have permission to view or edit anything". ``ForAdmins`` asks the role instead.
Changes go through actions, which write the audit log: most models are only shown here (``ReadOnlyAdmin``);
people's edits and token revocations are routed through their actions (controlplane/accounts/admin.py).
"""

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from controlplane.accounts.models import Role, User


def is_admin(request: HttpRequest) -> bool:
    user = request.user
    return isinstance(user, User) and user.has_role(Role.ADMIN)


class ForAdmins(admin.ModelAdmin):  # type: ignore[type-arg]
    """Shown to people with the admin role; what they may change is each admin's to say."""

    def has_module_permission(self, request: HttpRequest) -> bool:
        return is_admin(request)

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return is_admin(request)


class ReadOnlyAdmin(ForAdmins):
    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
