"""What the control plane needs to know of the TLS proxy in front of it, and how it guards logins.

``deploy/`` puts the control plane on loopback behind a TLS proxy (nginx, Caddy). The proxy speaks HTTPS
to browsers and plain HTTP to uvicorn, so unless Django is told to believe the proxy's
``X-Forwarded-Proto``, it takes every request for plain HTTP: the CSRF check then refuses every login
form posted from an ``https://`` page (its Origin does not match), and cookies cannot be marked secure.
The variables below say so (read by controlplane/settings.py; each is documented in
deploy/systemd/env/controlplane.env and the README):

* ``FLOTILLA_TRUST_X_FORWARDED_PROTO``: believe ``X-Forwarded-Proto: https`` (only behind a proxy that
  sets it on every request: a client could send it otherwise).
* ``FLOTILLA_CSRF_TRUSTED_ORIGINS``: origins (``https://flotilla.example.com``) whose forms may post here
  besides the request's own host, e.g. when the proxy rewrites the Host header.
* ``FLOTILLA_SECURE_COOKIES``: session and CSRF cookies only over HTTPS.
* ``FLOTILLA_HSTS_SECONDS`` (0: no header), ``FLOTILLA_HSTS_INCLUDE_SUBDOMAINS``, ``FLOTILLA_HSTS_PRELOAD``.
* ``FLOTILLA_LOGIN_MAX_FAILURES`` failed logins per user name and address within
  ``FLOTILLA_LOGIN_WINDOW_S`` seconds, after which that pair waits (controlplane/accounts/throttle.py).
* ``FLOTILLA_PASSWORD_MIN_LENGTH``: the shortest password Django's validators accept.

The defaults here suit a control plane on plain HTTP (a development machine, ``flotilla up``, which says what
they leave off: ``relaxed``). Production is the systemd unit, flotilla-controlplane.service, which sets
``PRODUCTION`` (the proxy trusted, secure cookies, a year of HSTS) unless /etc/flotilla/controlplane.env says
otherwise; tests/deploy/test_units.py checks that the two agree.
"""

from dataclasses import dataclass
from urllib.parse import urlsplit

from runtime.config import env_bool, env_int, env_list
from runtime.errors import ConfigError

#: What flotilla-controlplane.service sets (its ``Environment=`` lines), behind the TLS proxy deploy/ puts in
#: front of it: the proxy's X-Forwarded-Proto believed (the unit listens on loopback, where the proxy is),
#: cookies over HTTPS only, and browsers told to keep to HTTPS for a year (Django sends the header only on
#: HTTPS requests; not for subdomains, nor preloaded: those commit other hosts, an operator's choice).
PRODUCTION = {
    "FLOTILLA_TRUST_X_FORWARDED_PROTO": "true",
    "FLOTILLA_SECURE_COOKIES": "true",
    "FLOTILLA_HSTS_SECONDS": "31536000",
}


@dataclass(frozen=True)
class WebSecurity:
    """The web-security settings, as Django names them where it has a name."""

    secure_proxy_ssl_header: tuple[str, str] | None
    csrf_trusted_origins: list[str]
    secure_cookies: bool
    hsts_seconds: int
    hsts_include_subdomains: bool
    hsts_preload: bool
    login_max_failures: int
    login_window_s: int
    password_min_length: int

    def password_validators(self) -> list[dict[str, object]]:
        """Django's four validators, the length one at ``password_min_length``."""
        prefix = "django.contrib.auth.password_validation."
        return [
            {"NAME": prefix + "UserAttributeSimilarityValidator"},
            {"NAME": prefix + "MinimumLengthValidator", "OPTIONS": {"min_length": self.password_min_length}},
            {"NAME": prefix + "CommonPasswordValidator"},
            {"NAME": prefix + "NumericPasswordValidator"},
        ]


def relaxed(security: WebSecurity) -> list[str]:
    """What ``security`` leaves off that production (``PRODUCTION``) turns on, each in words; [] for none."""
    off = []
    if security.secure_proxy_ssl_header is None:
        off.append("a TLS proxy's X-Forwarded-Proto is not believed (FLOTILLA_TRUST_X_FORWARDED_PROTO)")
    if not security.secure_cookies:
        off.append("session and CSRF cookies also go over plain HTTP (FLOTILLA_SECURE_COOKIES)")
    if security.hsts_seconds == 0:
        off.append("no Strict-Transport-Security header (FLOTILLA_HSTS_SECONDS)")
    return off


def web_security() -> WebSecurity:
    """Read the variables above; raise ConfigError naming the variable whose value is unusable."""
    hsts_seconds = env_int("FLOTILLA_HSTS_SECONDS", 0, minimum=0)
    include_subdomains = env_bool("FLOTILLA_HSTS_INCLUDE_SUBDOMAINS", False)
    preload = env_bool("FLOTILLA_HSTS_PRELOAD", False)
    if (include_subdomains or preload) and hsts_seconds == 0:
        # Django would drop them silently with no Strict-Transport-Security header to add them to.
        raise ConfigError("FLOTILLA_HSTS_INCLUDE_SUBDOMAINS and FLOTILLA_HSTS_PRELOAD need FLOTILLA_HSTS_SECONDS > 0")
    return WebSecurity(
        secure_proxy_ssl_header=(
            ("HTTP_X_FORWARDED_PROTO", "https") if env_bool("FLOTILLA_TRUST_X_FORWARDED_PROTO", False) else None
        ),
        csrf_trusted_origins=[_origin(value) for value in env_list("FLOTILLA_CSRF_TRUSTED_ORIGINS")],
        secure_cookies=env_bool("FLOTILLA_SECURE_COOKIES", False),
        hsts_seconds=hsts_seconds,
        hsts_include_subdomains=include_subdomains,
        hsts_preload=preload,
        login_max_failures=env_int("FLOTILLA_LOGIN_MAX_FAILURES", 5, minimum=1),
        login_window_s=env_int("FLOTILLA_LOGIN_WINDOW_S", 300, minimum=1),
        password_min_length=env_int("FLOTILLA_PASSWORD_MIN_LENGTH", 12, minimum=8),
    )


def _origin(value: str) -> str:
    """An origin as Django compares them (``scheme://host[:port]``); ConfigError for anything else."""
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.path not in ("", "/"):
        raise ConfigError(
            f"FLOTILLA_CSRF_TRUSTED_ORIGINS: {value!r} is not an origin (scheme and host, e.g. https://flotilla.example.com)"
        )
    if parts.query or parts.fragment or "@" in parts.netloc:
        raise ConfigError(f"FLOTILLA_CSRF_TRUSTED_ORIGINS: {value!r} is not an origin (scheme and host only)")
    return f"{parts.scheme}://{parts.netloc}"
