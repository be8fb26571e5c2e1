"""``manage.py createtoken``: a token for a person (created with a role if new) or for a node's agent.

    manage.py createtoken --user alice --role operator      # prints a token acting as alice
    manage.py createtoken --agent gpu-a                      # prints the agent token of node gpu-a

The key is printed once, on stdout alone, so that scripts can capture it; it is stored only hashed.
"""

from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlplane.accounts import actions
from controlplane.accounts.models import Role, User
from controlplane.audit.records import Actor
from controlplane.errors import ControlPlaneError
from controlplane.fleet.models import validate_node_name

ACTOR = Actor.system("manage.py createtoken")


class Command(BaseCommand):
    help = "Create an API token for a person (--user, created if new) or for a node's agent (--agent)."

    def add_arguments(self, parser: CommandParser) -> None:
        who = parser.add_mutually_exclusive_group(required=True)
        who.add_argument("--user", help="the person's username (created with --role when new)")
        who.add_argument("--agent", metavar="NODE", help="the node whose agent gets the token")
        parser.add_argument(
            "--role",
            choices=Role.values,
            help="role of a new user (default read_only); given for an existing user, changes it",
        )
        parser.add_argument("--description", default="", help="what the token is for")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            if options["agent"] is not None:
                key = self._agent_token(options["agent"], options["description"])
            else:
                key = self._person_token(options["user"], options["role"], options["description"])
        except ControlPlaneError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(key)

    def _agent_token(self, node_name: str, description: str) -> str:
        if problem := _node_name_error(node_name):
            raise CommandError(f"--agent: {problem}")
        _, key = actions.create_agent_token(ACTOR, node_name, description)
        return key

    def _person_token(self, username: str, role: str | None, description: str) -> str:
        user = User.objects.filter(username=username).first()
        if user is None:
            user = actions.create_user(ACTOR, username, Role(role or Role.READ_ONLY))
            self.stderr.write(f"created user {username} ({user.effective_role.label}; no password: tokens only)")
        elif role is not None and role != user.role:
            actions.set_role(ACTOR, user, Role(role))
            self.stderr.write(f"{username} is now {Role(role).label}")
        _, key = actions.create_person_token(ACTOR, user, description)
        return key


def _node_name_error(name: str) -> str:
    try:
        validate_node_name(name)
    except ValidationError as exc:
        return f"{name!r}: {exc.messages[0]}"
    return ""
