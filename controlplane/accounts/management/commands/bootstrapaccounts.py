"""``manage.py bootstrapaccounts``: the accounts ``flotilla up`` needs, made the first time and kept after.

    FLOTILLA_UP_PASSWORD=… FLOTILLA_UP_ADMIN_TOKEN=… FLOTILLA_UP_AGENT_TOKEN=… \\
        manage.py bootstrapaccounts --admin admin --node local [--api-key-name "flotilla up"]

``flotilla up`` runs it after the migrations each time it starts (launcher/stack/controlplane.py). Through the
control plane's actions, so that each account, token and key gets its audit entry, it makes sure of:

* the admin ``--admin``: created (role admin, password FLOTILLA_UP_PASSWORD) only when no user has that name;
* a token of the admin: a new one only when FLOTILLA_UP_ADMIN_TOKEN (the one kept in the data folder) is not, or
  no longer, one of the admin's, such as after a switch to another DATABASE_URL;
* an agent token of node ``--node``: a new one only when FLOTILLA_UP_AGENT_TOKEN is not one of that node's;
* with ``--api-key-name``: an API key of the admin by that name, a new one only when FLOTILLA_UP_API_KEY is not
  the admin's live key of that name; the admin's other live keys of that name are revoked (their file is gone:
  nobody can use them any more). Then every key's record is put in etcd (``ETCD_ENDPOINTS``): `flotilla up`
  starts a fresh etcd each time, and its gateway, which starts next, must know the keys that exist from its
  first request on, not only once the beat's sync has run (up to ``FLOTILLA_API_KEYS_SYNC_S`` later).

The secrets come in environment variables, never on the command line (which anyone on the machine can read
in ``ps``). It prints one JSON line on stdout, the keys it created (null where the kept one still works)::

    {"admin_created": true, "admin_token": "flt_…", "agent_token": "flt_…", "api_key": null}
"""

import json
import os
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlplane.accounts import actions
from controlplane.accounts.models import ApiToken, Role, User, hash_token
from controlplane.apikeys import actions as key_actions
from controlplane.apikeys import publication
from controlplane.apikeys.models import ApiKey
from controlplane.audit.records import Actor
from controlplane.errors import ControlPlaneError
from runtime.errors import DiscoveryUnavailable
from runtime.fleet_contract.api_keys import key_hash

ACTOR = Actor.system("flotilla up")
#: The password of a new admin.
PASSWORD_VARIABLE = "FLOTILLA_UP_PASSWORD"
#: The keys ``flotilla up`` kept from earlier runs ("" or unset: none).
ADMIN_TOKEN_VARIABLE = "FLOTILLA_UP_ADMIN_TOKEN"
AGENT_TOKEN_VARIABLE = "FLOTILLA_UP_AGENT_TOKEN"
API_KEY_VARIABLE = "FLOTILLA_UP_API_KEY"


class Command(BaseCommand):
    help = (
        "Make sure of the accounts `flotilla up` needs: its admin, the admin's token, the local agent's token and "
        f"(--api-key-name) the admin's API key. Secrets by environment: {PASSWORD_VARIABLE} (a new admin's "
        f"password), {ADMIN_TOKEN_VARIABLE}, {AGENT_TOKEN_VARIABLE} and {API_KEY_VARIABLE} (the keys kept from "
        "earlier runs). Prints one JSON line: the keys it had to create."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--admin", required=True, help="the admin's username (created when new)")
        parser.add_argument("--node", required=True, help="the node whose agent gets the token")
        parser.add_argument("--api-key-name", help="the name of the admin's API key (default: no API key)")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            result = self._bootstrap(options["admin"], options["node"], options["api_key_name"])
        except ControlPlaneError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(json.dumps(result))

    def _bootstrap(self, username: str, node_name: str, api_key_name: str | None) -> dict[str, Any]:
        result: dict[str, Any] = {"admin_created": False, "admin_token": None, "agent_token": None, "api_key": None}
        admin = User.objects.filter(username=username).first()
        if admin is None:
            if PASSWORD_VARIABLE not in os.environ:
                raise CommandError(f"{PASSWORD_VARIABLE} is not set: it is the password of the new admin {username}")
            admin = actions.create_user(ACTOR, username, Role.ADMIN, password=os.environ[PASSWORD_VARIABLE])
            result["admin_created"] = True
        if not _known_token(os.environ.get(ADMIN_TOKEN_VARIABLE, ""), user=admin):
            result["admin_token"] = actions.create_person_token(ACTOR, admin, "flotilla up")[1]
        if not _known_token(os.environ.get(AGENT_TOKEN_VARIABLE, ""), kind=ApiToken.Kind.AGENT, node_name=node_name):
            result["agent_token"] = actions.create_agent_token(ACTOR, node_name, "flotilla up: the local agent")[1]
        if api_key_name:
            result["api_key"] = _api_key(admin, api_key_name, os.environ.get(API_KEY_VARIABLE, ""))
            self._publish_keys()
        return result

    def _publish_keys(self) -> None:
        """Every key's record in etcd now; when etcd does not answer, say so and leave it to the beat's sync."""
        try:
            publication.sync()
        except DiscoveryUnavailable as exc:
            self.stderr.write(f"the API keys are not in etcd yet ({exc}); the control plane's sync puts them there")


def _known_token(key: str, **owner: Any) -> bool:
    """Whether ``key`` is a token of ``owner`` (the filters of ApiToken that say whose)."""
    return bool(key) and ApiToken.objects.filter(key_hash=hash_token(key), **owner).exists()


def _api_key(admin: User, name: str, kept: str) -> str | None:
    """A new key of ``admin`` named ``name``, or None when ``kept`` is the admin's live key of that name."""
    mine = ApiKey.objects.filter(owner=admin, name=name, revoked_at__isnull=True)
    if kept and mine.filter(key_hash=key_hash(kept)).exists():
        return None
    for lost in mine:  # its file is gone: nobody can use it any more
        key_actions.revoke_key(ACTOR, lost)
    return key_actions.create_key(ACTOR, admin, name)[1]
