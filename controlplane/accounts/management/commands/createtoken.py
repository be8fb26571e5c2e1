"""``manage.py createtoken``: a token for a person (created with a role if new) or for a node's agent.

    manage.py createtoken --user alice --role operator      # prints a token acting as alice
    manage.py createtoken --user grafana --scope read --expires-in 90d   # reads only, for 90 days
    manage.py createtoken --agent gpu-a                      # prints the agent token of node gpu-a
    manage.py createtoken --agent gpu-a --revoke-old         # a new one; gpu-a's older tokens stop working

The key is printed once, on stdout alone, so that scripts can capture it; it is stored only hashed.
"""

import argparse
import datetime
import re
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from controlplane.accounts import actions
from controlplane.accounts.models import ApiToken, Role, User
from controlplane.audit.records import Actor
from controlplane.errors import ControlPlaneError
from controlplane.fleet.models import validate_node_name

ACTOR = Actor.system("manage.py createtoken")
_UNITS = {"m": "minutes", "h": "hours", "d": "days", "w": "weeks"}
_DURATION = re.compile(r"([1-9][0-9]{0,5})([mhdw])")


def duration(text: str) -> datetime.timedelta:
    """``30d``, ``12h``, ``90m`` or ``2w`` as a timedelta. Raises argparse's error for anything else."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 90m, 12h, 30d or 2w")
    return datetime.timedelta(**{_UNITS[match[2]]: int(match[1])})


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
        parser.add_argument(
            "--expires-in",
            type=duration,
            metavar="DURATION",
            help="the token stops working after this long: 90m, 12h, 30d, 2w (default: never)",
        )
        parser.add_argument(
            "--scope",
            choices=ApiToken.Scope.values,
            default=ApiToken.Scope.FULL,
            help="with --user: 'read' makes a token that only reads (GET), whatever the person's role, e.g. for "
            "a monitoring script (default 'full': what the role allows)",
        )
        parser.add_argument(
            "--revoke-old",
            action="store_true",
            help="with --agent: revoke the node's other agent tokens now, in the same transaction. Their agent "
            "is refused (401) at its next heartbeat and stops with exit code 2 (its workers keep serving), and "
            "their keys sign none of the node's tasks from then on. Not the default, because a planned rotation "
            "should not stop a running agent: create the new token, install it, restart the agent, then revoke "
            "the old one (DELETE /api/v1/tokens/ID/, or the admin). Use it at once for a token that leaked",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        expires_at = timezone.now() + options["expires_in"] if options["expires_in"] is not None else None
        try:
            if options["agent"] is not None:
                if options["scope"] != ApiToken.Scope.FULL:
                    raise CommandError("--scope is for a person's token (--user): an agent's endpoints all write")
                key = self._agent_token(options["agent"], options["description"], expires_at, options["revoke_old"])
            else:
                if options["revoke_old"]:
                    raise CommandError("--revoke-old is for an agent's token (--agent)")
                key = self._person_token(
                    options["user"], options["role"], options["description"], options["scope"], expires_at
                )
        except ControlPlaneError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(key)

    def _agent_token(
        self, node_name: str, description: str, expires_at: datetime.datetime | None, revoke_old: bool
    ) -> str:
        if problem := _node_name_error(node_name):
            raise CommandError(f"--agent: {problem}")
        older = [str(token) for token in ApiToken.objects.filter(kind=ApiToken.Kind.AGENT, node_name=node_name)]
        _, key = actions.create_agent_token(ACTOR, node_name, description, expires_at=expires_at, revoke_old=revoke_old)
        if older and revoke_old:
            self.stderr.write(f"revoked node {node_name}'s older agent token(s): {', '.join(older)}")
        elif older:
            self.stderr.write(
                f"node {node_name}'s older agent token(s) still work: {', '.join(older)} (--revoke-old revokes them)"
            )
        return key

    def _person_token(
        self, username: str, role: str | None, description: str, scope: str, expires_at: datetime.datetime | None
    ) -> str:
        user = User.objects.filter(username=username).first()
        if user is None:
            user = actions.create_user(ACTOR, username, Role(role or Role.READ_ONLY))
            self.stderr.write(f"created user {username} ({user.effective_role.label}; no password: tokens only)")
        elif role is not None and role != user.role:
            actions.set_role(ACTOR, user, Role(role))
            self.stderr.write(f"{username} is now {Role(role).label}")
        _, key = actions.create_person_token(
            ACTOR, user, description, scope=ApiToken.Scope(scope), expires_at=expires_at
        )
        return key


def _node_name_error(name: str) -> str:
    try:
        validate_node_name(name)
    except ValidationError as exc:
        return f"{name!r}: {exc.messages[0]}"
    return ""
