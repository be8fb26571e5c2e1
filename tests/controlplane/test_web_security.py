"""Behind the TLS proxy deploy/ recommends: the settings come from the environment, and a login posted from an
https:// page passes the CSRF check once the proxy is trusted."""

import importlib

import pytest
from django.test import Client, override_settings

from controlplane import settings as settings_module
from controlplane.csrf_failure import PLAIN_HTTP_WITH_SECURE_COOKIES
from controlplane.web_security import PRODUCTION, relaxed, web_security
from runtime.errors import ConfigError
from tests.controlplane.factories import make_user

PASSWORD = "a long passphrase"
PUBLIC = "flotilla.example.com"
VARIABLES = (
    "FLOTILLA_TRUST_X_FORWARDED_PROTO",
    "FLOTILLA_CSRF_TRUSTED_ORIGINS",
    "FLOTILLA_SECURE_COOKIES",
    "FLOTILLA_HSTS_SECONDS",
    "FLOTILLA_HSTS_INCLUDE_SUBDOMAINS",
    "FLOTILLA_HSTS_PRELOAD",
    "FLOTILLA_LOGIN_MAX_FAILURES",
    "FLOTILLA_LOGIN_WINDOW_S",
    "FLOTILLA_PASSWORD_MIN_LENGTH",
)


@pytest.fixture(autouse=True)
def unset(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)


def behind_a_proxy(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """The Django settings that controlplane/settings.py makes of a production env file."""
    monkeypatch.setenv("FLOTILLA_TRUST_X_FORWARDED_PROTO", "yes")
    monkeypatch.setenv("FLOTILLA_CSRF_TRUSTED_ORIGINS", f"https://{PUBLIC}, https://other.example.com:8443")
    monkeypatch.setenv("FLOTILLA_SECURE_COOKIES", "true")
    monkeypatch.setenv("FLOTILLA_HSTS_SECONDS", "31536000")
    monkeypatch.setenv("FLOTILLA_HSTS_INCLUDE_SUBDOMAINS", "1")
    module = importlib.reload(settings_module)
    try:
        names = (
            "SECURE_PROXY_SSL_HEADER",
            "CSRF_TRUSTED_ORIGINS",
            "SESSION_COOKIE_SECURE",
            "CSRF_COOKIE_SECURE",
            "SECURE_HSTS_SECONDS",
            "SECURE_HSTS_INCLUDE_SUBDOMAINS",
        )
        return {name: getattr(module, name) for name in names}
    finally:
        monkeypatch.undo()
        importlib.reload(settings_module)


def test_the_proxy_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert behind_a_proxy(monkeypatch) == {
        "SECURE_PROXY_SSL_HEADER": ("HTTP_X_FORWARDED_PROTO", "https"),
        "CSRF_TRUSTED_ORIGINS": [f"https://{PUBLIC}", "https://other.example.com:8443"],
        "SESSION_COOKIE_SECURE": True,
        "CSRF_COOKIE_SECURE": True,
        "SECURE_HSTS_SECONDS": 31536000,
        "SECURE_HSTS_INCLUDE_SUBDOMAINS": True,
    }


def test_by_default_nothing_is_trusted_and_cookies_also_go_over_http() -> None:
    security = web_security()
    assert security.secure_proxy_ssl_header is None
    assert security.csrf_trusted_origins == []
    assert (security.secure_cookies, security.hsts_seconds) == (False, 0)


def test_the_production_settings_relax_nothing_and_the_defaults_say_what_they_relax(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert [text.rsplit("(", 1)[1] for text in relaxed(web_security())] == [
        "FLOTILLA_TRUST_X_FORWARDED_PROTO)",
        "FLOTILLA_SECURE_COOKIES)",
        "FLOTILLA_HSTS_SECONDS)",
    ]
    for name, value in PRODUCTION.items():
        monkeypatch.setenv(name, value)
    security = web_security()
    assert relaxed(security) == []
    assert (security.secure_proxy_ssl_header, security.secure_cookies) == (("HTTP_X_FORWARDED_PROTO", "https"), True)
    assert (security.hsts_seconds, security.hsts_include_subdomains, security.hsts_preload) == (31536000, False, False)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("FLOTILLA_CSRF_TRUSTED_ORIGINS", "flotilla.example.com", "is not an origin"),
        ("FLOTILLA_CSRF_TRUSTED_ORIGINS", "https://flotilla.example.com/login/", "is not an origin"),
        ("FLOTILLA_TRUST_X_FORWARDED_PROTO", "maybe", "is not a boolean"),
        ("FLOTILLA_HSTS_SECONDS", "-1", "below the minimum"),
        ("FLOTILLA_HSTS_PRELOAD", "1", "need FLOTILLA_HSTS_SECONDS > 0"),
        ("FLOTILLA_LOGIN_MAX_FAILURES", "0", "below the minimum"),
        ("FLOTILLA_PASSWORD_MIN_LENGTH", "4", "below the minimum"),
    ],
)
def test_a_bad_value_is_refused_naming_its_variable(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, message: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=name) as raised:
        web_security()
    assert message in str(raised.value)


@pytest.mark.django_db
def test_a_login_through_the_tls_proxy_passes_the_csrf_check_and_gets_secure_cookies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    user = make_user("bob")
    user.set_password(PASSWORD)
    user.save()
    proxied = {"HTTP_X_FORWARDED_PROTO": "https", "HTTP_HOST": PUBLIC, "HTTP_ORIGIN": f"https://{PUBLIC}"}
    with override_settings(ALLOWED_HOSTS=[PUBLIC], **behind_a_proxy(monkeypatch)):
        browser = Client(enforce_csrf_checks=True)
        page = browser.get("/login/", **proxied)
        assert page["Strict-Transport-Security"] == "max-age=31536000; includeSubDomains"
        assert page.cookies["csrftoken"]["secure"]
        token = page.cookies["csrftoken"].value
        form = {"username": "bob", "password": PASSWORD, "csrfmiddlewaretoken": token, "next": "/"}
        response = browser.post("/login/", form, **proxied)
    assert (response.status_code, response["Location"]) == (302, "/")
    assert response.cookies["sessionid"]["secure"]


@pytest.mark.django_db
def test_without_trusting_the_proxy_the_same_login_is_refused_as_cross_origin() -> None:
    # What happened before: Django took the proxied request for http:// and the https:// Origin for another site.
    make_user("bob")
    proxied = {"HTTP_X_FORWARDED_PROTO": "https", "HTTP_HOST": PUBLIC, "HTTP_ORIGIN": f"https://{PUBLIC}"}
    with override_settings(ALLOWED_HOSTS=[PUBLIC]):
        browser = Client(enforce_csrf_checks=True)
        token = browser.get("/login/", **proxied).cookies["csrftoken"].value
        response = browser.post(
            "/login/", {"username": "bob", "password": "x", "csrfmiddlewaretoken": token}, **proxied
        )
    assert response.status_code == 403


@pytest.mark.django_db
def test_a_login_posted_from_a_plain_http_page_with_secure_cookies_on_says_why_it_is_refused() -> None:
    # A browser keeps no Secure cookie from an http:// page: the form arrives without its CSRF cookie.
    make_user("bob")
    with override_settings(CSRF_COOKIE_SECURE=True, SESSION_COOKIE_SECURE=True):
        response = Client(enforce_csrf_checks=True).post("/login/", {"username": "bob", "password": "x"})
        assert response.status_code == 403
        assert response.content.decode() == PLAIN_HTTP_WITH_SECURE_COOKIES
        # Over HTTPS the same missing cookie is another fault: Django's own page names it.
        response = Client(enforce_csrf_checks=True).post("/login/", {"username": "bob"}, secure=True)
    assert response.status_code == 403 and "FLOTILLA_SECURE_COOKIES" not in response.content.decode()
