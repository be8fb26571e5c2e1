"""The page of a form refused by Django's CSRF check, with the one cause it cannot name itself explained.

With secure cookies on (FLOTILLA_SECURE_COOKIES, the systemd unit's default) a browser on a plain-HTTP page
keeps no CSRF cookie, so every login form is refused as "CSRF cookie not set". That happens when the control
plane is reached without its TLS proxy, or through a proxy it does not believe: this page says so, and how to
fix it, instead of Django's generic one. Every other refusal gets Django's page.
"""

from django.conf import settings
from django.http import HttpRequest, HttpResponse, HttpResponseForbidden
from django.middleware.csrf import REASON_NO_CSRF_COOKIE
from django.views.csrf import csrf_failure as django_csrf_failure

PLAIN_HTTP_WITH_SECURE_COOKIES = (
    "Refused: this control plane sends its cookies over HTTPS only (FLOTILLA_SECURE_COOKIES), and this page "
    "came over plain HTTP, so your browser kept no CSRF cookie to check the form with.\n\n"
    "Open it through its TLS proxy (https://), with FLOTILLA_TRUST_X_FORWARDED_PROTO=true when the proxy sets "
    "X-Forwarded-Proto. A control plane reached over plain HTTP on purpose: set FLOTILLA_SECURE_COOKIES=false "
    "and FLOTILLA_HSTS_SECONDS=0 in /etc/flotilla/controlplane.env, then restart it (docs/operations.md).\n"
)


def csrf_failure(request: HttpRequest, reason: str = "") -> HttpResponse:
    """403: the plain-HTTP explanation above when it applies, else Django's own page."""
    if reason == REASON_NO_CSRF_COOKIE and settings.CSRF_COOKIE_SECURE and not request.is_secure():
        return HttpResponseForbidden(PLAIN_HTTP_WITH_SECURE_COOKIES, content_type="text/plain; charset=utf-8")
    return django_csrf_failure(request, reason)
