"""manage.py createtoken: tokens for people (created with a role) and for agents."""

import io

import pytest
from django.core.management import CommandError, call_command
from rest_framework.test import APIClient

from controlplane.accounts.models import ApiToken, Role, User
from controlplane.audit.models import AuditEntry

pytestmark = pytest.mark.django_db


def create_token(*args: str) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    call_command("createtoken", *args, stdout=out, stderr=err)
    return out.getvalue().strip(), err.getvalue()


def test_a_new_person_gets_the_role_and_a_working_token() -> None:
    key, note = create_token("--user", "root", "--role", "admin")
    assert "created user root (admin; no password: tokens only)" in note
    user = User.objects.get(username="root")
    assert (user.role, user.has_usable_password()) == (Role.ADMIN, False)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    assert client.get("/api/v1/tokens/").status_code == 200
    assert AuditEntry.objects.filter(action="token.create", actor_name="system:manage.py createtoken").exists()


def test_a_role_given_for_an_existing_person_changes_it() -> None:
    create_token("--user", "bob")
    assert User.objects.get(username="bob").role == Role.READ_ONLY
    _, note = create_token("--user", "bob", "--role", "operator")
    assert "bob is now operator" in note
    assert User.objects.get(username="bob").role == Role.OPERATOR
    assert ApiToken.objects.filter(user__username="bob").count() == 2


def test_an_agent_token_is_only_for_its_node() -> None:
    key, _ = create_token("--agent", "gpu-a")
    token = ApiToken.objects.get()
    assert (token.kind, token.node_name, token.user) == ("agent", "gpu-a", None)
    assert key.startswith(token.key_start) and token.key_hash != key
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    response = client.post("/api/v1/agent/register/", {"name": "gpu-a"}, format="json")
    assert response.status_code == 200


def test_a_bad_node_name_is_refused_naming_the_flag() -> None:
    with pytest.raises(CommandError, match="--agent: 'GPU_A'"):
        create_token("--agent", "GPU_A")
