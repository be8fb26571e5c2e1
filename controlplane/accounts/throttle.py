"""Login throttling: after ``LOGIN_MAX_FAILURES`` failed logins for one user name from one address within
``LOGIN_WINDOW_S`` seconds, that pair is refused until the oldest of those failures is a window old.

Keyed by user name *and* address, so that someone guessing a person's password from one machine does not
lock that person out everywhere. The address is the request's client as uvicorn reports it: behind a
proxy on loopback, uvicorn takes it from ``X-Forwarded-For`` (its ``--forwarded-allow-ips``, 127.0.0.1 by
default), so each browser is counted apart rather than all as the proxy.
"""

import math
from datetime import datetime, timedelta

from django.conf import settings
from django.http import HttpRequest
from django.utils import timezone

from controlplane.accounts.models import FailedLogin


def client_address(request: HttpRequest | None) -> str:
    return (request.META.get("REMOTE_ADDR") or "") if request is not None else ""


def wait_s(username: str, address: str, *, now: datetime | None = None) -> int:
    """Seconds before ``username`` may try again from ``address``; 0 when it may now."""
    now = now or timezone.now()
    window = timedelta(seconds=settings.LOGIN_WINDOW_S)
    recent = list(
        FailedLogin.objects.filter(username=_key(username), address=address, at__gt=now - window)
        .order_by("-at")
        .values_list("at", flat=True)[: settings.LOGIN_MAX_FAILURES]
    )
    if len(recent) < settings.LOGIN_MAX_FAILURES:
        return 0
    # The oldest of the last MAX failures leaving the window lets one more attempt in.
    return max(1, math.ceil((recent[-1] + window - now).total_seconds()))


def failed(username: str, address: str) -> None:
    """Count a failed login, and forget every failure past the window (so that guesses spread over many user
    names do not grow the table for good)."""
    now = timezone.now()
    FailedLogin.objects.filter(at__lte=now - timedelta(seconds=settings.LOGIN_WINDOW_S)).delete()
    FailedLogin.objects.create(username=_key(username), address=address, at=now)


def succeeded(username: str, address: str) -> None:
    """A successful login clears the pair's failures."""
    FailedLogin.objects.filter(username=_key(username), address=address).delete()


def _key(username: str) -> str:
    # Case-folded: "Admin" and "admin" share a count whatever the backend makes of them.
    return username.casefold()[:150]
