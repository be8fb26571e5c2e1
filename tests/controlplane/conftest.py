"""Fixtures of the control-plane tests: API clients for each role and for agents."""

from collections.abc import Callable

import pytest
from rest_framework.test import APIClient

from controlplane.accounts.models import Role
from controlplane.deployments import log_tail
from tests.controlplane.factories import agent_token, make_user, person_token
from tests.controlplane.reconciling import RecordingDispatcher


@pytest.fixture
def client_for(db: None) -> Callable[[Role | None], APIClient]:
    """``client_for(Role.OPERATOR)`` is an API client with a token of a new person with that role
    (``None``: an anonymous client)."""
    counter = iter(range(1000))

    def build(role: Role | None) -> APIClient:
        client = APIClient()
        if role is not None:
            user = make_user(f"{role.value}-{next(counter)}", role)
            client.credentials(HTTP_AUTHORIZATION=f"Bearer {person_token(user)}")
        return client

    return build


@pytest.fixture
def operator(client_for: Callable[[Role | None], APIClient]) -> APIClient:
    return client_for(Role.OPERATOR)


@pytest.fixture
def admin(client_for: Callable[[Role | None], APIClient]) -> APIClient:
    return client_for(Role.ADMIN)


@pytest.fixture
def reader(client_for: Callable[[Role | None], APIClient]) -> APIClient:
    return client_for(Role.READ_ONLY)


@pytest.fixture
def agent_client(db: None) -> Callable[[str], APIClient]:
    """``agent_client("gpu-a")`` is an API client with node gpu-a's agent token."""

    def build(node_name: str) -> APIClient:
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {agent_token(node_name)}")
        return client

    return build


@pytest.fixture
def log_dispatcher(monkeypatch: pytest.MonkeyPatch) -> RecordingDispatcher:
    """Log tails asked of agents (the API's and the dashboard's) are recorded here instead of sent."""
    recording = RecordingDispatcher()
    monkeypatch.setattr(log_tail, "agent_dispatcher", lambda: recording)
    return recording
