"""Who may call what: people by role, agents only on their own node's agent endpoints.

A viewset says which role each of its actions needs (``FlotillaViewSet.required_role``); reading needs
read-only, changing needs operator unless the viewset says otherwise. A person's token of scope "read"
passes only for safe methods (GET, HEAD, OPTIONS), whatever its person's role. Agent tokens never pass
``RolePermission``, and people never pass ``AgentPermission``.
"""

from typing import Any

from rest_framework.permissions import SAFE_METHODS, BasePermission
from rest_framework.request import Request

from controlplane.accounts.authentication import AgentPrincipal
from controlplane.accounts.models import ApiToken, Role, User


class RolePermission(BasePermission):
    """The caller is a person whose role is at least what the view's action needs."""

    message = "your role does not allow this"

    def has_permission(self, request: Request, view: Any) -> bool:
        user = request.user
        if not isinstance(user, User):
            if isinstance(user, AgentPrincipal):
                self.message = "an agent token may only use the agent endpoints"
            return False
        token = request.auth
        if isinstance(token, ApiToken) and token.scope == ApiToken.Scope.READ and request.method not in SAFE_METHODS:
            self.message = (
                f"this token (key {token.key_start}…) is read-only (scope 'read'): it may only read, whatever "
                "your role; use a token of scope 'full' to change anything"
            )
            return False
        needed: Role = view.required_role()
        if not user.has_role(needed):
            self.message = f"this needs the {needed.label} role; yours is {user.effective_role.label}"
            return False
        return True


class AgentPermission(BasePermission):
    """The caller is a node agent (the views check that it acts only on its own node)."""

    message = "only a node agent's token may use this endpoint"

    def has_permission(self, request: Request, view: Any) -> bool:
        return isinstance(request.user, AgentPrincipal)
