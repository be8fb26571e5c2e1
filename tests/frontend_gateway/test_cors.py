"""Browsers calling the gateway from another origin's page (CORS, frontend_gateway/cors.py): only the origins given
with --allowed-origins, a preflight answered for them and refused for others, and each answer to them readable
(its rate-limit headers exposed). With none given, the gateway answers as it always did: OPTIONS is a 405."""

from collections.abc import AsyncIterator

import httpx2
import pytest

from engines.echo import EchoFullEngine
from frontend_gateway.http_app import GatewayApp
from frontend_gateway.models.pipeline import ModelRegistry, TextModel

DASHBOARD = "http://127.0.0.1:8000"
PREFLIGHT = {"access-control-request-method": "POST", "access-control-request-headers": "authorization,content-type"}
CHAT = {"model": "echo", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


async def client_for(*origins: str) -> AsyncIterator[httpx2.AsyncClient]:
    registry = ModelRegistry()
    registry.add(TextModel("echo", EchoFullEngine(0.0)))
    transport = httpx2.ASGITransport(app=GatewayApp(registry, allowed_origins=origins))
    async with httpx2.AsyncClient(transport=transport, base_url="http://gateway") as http:
        yield http


@pytest.fixture
async def allowing_the_dashboard() -> AsyncIterator[httpx2.AsyncClient]:
    async for http in client_for(DASHBOARD):
        yield http


async def test_an_allowed_origins_preflight_is_answered_with_what_it_may_send(
    allowing_the_dashboard: httpx2.AsyncClient,
) -> None:
    reply = await allowing_the_dashboard.options("/v1/chat/completions", headers={"origin": DASHBOARD, **PREFLIGHT})
    assert reply.status_code == 204
    assert reply.headers["access-control-allow-origin"] == DASHBOARD
    assert "POST" in reply.headers["access-control-allow-methods"]
    assert reply.headers["access-control-allow-headers"] == "authorization,content-type"
    assert "access-control-allow-credentials" not in reply.headers  # keys travel in a header, not cookies


async def test_an_allowed_origins_answers_carry_its_origin_and_expose_the_rate_limit_headers(
    allowing_the_dashboard: httpx2.AsyncClient,
) -> None:
    reply = await allowing_the_dashboard.post("/v1/chat/completions", json=CHAT, headers={"origin": DASHBOARD})
    assert reply.status_code == 200
    assert reply.headers["access-control-allow-origin"] == DASHBOARD and reply.headers["vary"] == "Origin"
    assert "x-ratelimit-remaining-requests" in reply.headers["access-control-expose-headers"]
    # An error answer is readable too: the page shows the gateway's message.
    missing = await allowing_the_dashboard.post("/v1/chat/completions", json={}, headers={"origin": DASHBOARD})
    assert missing.status_code == 400 and missing.headers["access-control-allow-origin"] == DASHBOARD


async def test_another_origin_is_refused_its_preflight_and_gets_no_cors_headers(
    allowing_the_dashboard: httpx2.AsyncClient,
) -> None:
    other = "http://evil.example"
    preflight = await allowing_the_dashboard.options("/v1/chat/completions", headers={"origin": other, **PREFLIGHT})
    assert preflight.status_code == 403 and "--allowed-origins" in preflight.json()["error"]["message"]
    reply = await allowing_the_dashboard.post("/v1/chat/completions", json=CHAT, headers={"origin": other})
    assert reply.status_code == 200 and "access-control-allow-origin" not in reply.headers


async def test_without_allowed_origins_the_gateway_answers_as_before() -> None:
    async for http in client_for():
        preflight = await http.options("/v1/chat/completions", headers={"origin": DASHBOARD, **PREFLIGHT})
        assert preflight.status_code == 405
        reply = await http.post("/v1/chat/completions", json=CHAT, headers={"origin": DASHBOARD})
        assert "access-control-allow-origin" not in reply.headers


async def test_any_origin_is_allowed_with_a_star() -> None:
    async for http in client_for("*"):
        reply = await http.options("/v1/models", headers={"origin": "https://app.example", **PREFLIGHT})
        assert reply.status_code == 204 and reply.headers["access-control-allow-origin"] == "https://app.example"
