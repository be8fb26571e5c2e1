"""What every API viewset shares: role checks per action, the acting person, numeric ids in URLs."""

from typing import ClassVar

from rest_framework import viewsets
from rest_framework.permissions import SAFE_METHODS

from controlplane.accounts.models import Role
from controlplane.audit.records import Actor

# Ids are positive integers; anything else in the URL is a 404 before a query could overflow.
ID_PATTERN = "[0-9]{1,18}"


class FlotillaViewSet(viewsets.GenericViewSet):
    """Base of the people's API: reading needs ``read_role``, changing ``write_role``, unless
    ``action_roles`` names the action (``{"destroy": Role.ADMIN}``)."""

    read_role: ClassVar[Role] = Role.READ_ONLY
    write_role: ClassVar[Role] = Role.OPERATOR
    action_roles: ClassVar[dict[str, Role]] = {}
    lookup_value_regex = ID_PATTERN
    http_method_names: ClassVar[list[str]] = ["get", "post", "patch", "delete", "head", "options"]

    def required_role(self) -> Role:
        if self.action in self.action_roles:
            return self.action_roles[self.action]
        return self.read_role if self.request.method in SAFE_METHODS else self.write_role

    @property
    def actor(self) -> Actor:
        return Actor.person(self.request.user)
