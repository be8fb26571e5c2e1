"""The People page (admins: add people, change their role and details, deactivate, reactivate, reset a
password) and the Account page (everyone: change one's password, see and revoke one's own tokens; admins, who
may make tokens in the API, also make their own there).

Each change calls an accounts action (controlplane/accounts/actions.py) and so has its audit entry. The row
buttons are htmx POSTs answered with the fresh row and a note, as the other pages' buttons are
(controlplane/dashboard/controls.py); a refusal (400, 409) answers the same way with the reason. A password
made here (for a new person, or by a reset) is shown once, in the answer, and never stored in the session; so
is a new token's key.
"""

from collections.abc import Callable
from typing import Any

from django.contrib import messages
from django.contrib.auth import update_session_auth_hash
from django.contrib.auth.decorators import login_required
from django.db.models import Count, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.shortcuts import get_object_or_404, redirect
from django.template.loader import render_to_string
from django.views.decorators.http import require_http_methods, require_POST

from controlplane.accounts import actions, throttle
from controlplane.accounts.models import ApiToken, Role, User
from controlplane.audit.records import Actor
from controlplane.dashboard.access import role_required
from controlplane.dashboard.people_forms import NewPersonForm, OwnTokenForm, PasswordChange, PersonDetails
from controlplane.dashboard.views import render_page
from controlplane.errors import Conflict, Forbidden, Invalid

PEOPLE_ROLE = Role.ADMIN
# As in the REST API (``POST /api/v1/tokens/``): only admins make tokens, their own included.
TOKENS_ROLE = Role.ADMIN


def people_rows() -> QuerySet[User]:
    """Everyone, by username, with how many tokens each has."""
    return User.objects.annotate(token_count=Count("api_tokens")).order_by("username")


@role_required(PEOPLE_ROLE)
@require_http_methods(["GET", "POST"])
def people_page(request: HttpRequest) -> HttpResponse:
    """Everyone with their role and state, and the add-a-person form (whose answer shows the new password)."""
    form = NewPersonForm()
    created: tuple[User, str | None] | None = None
    status = 200
    if request.method == "POST":
        form = NewPersonForm(request.POST)
        created = form.submit(Actor.person(request.user))
        if created is None:
            status = 400
        else:
            form = NewPersonForm()
    context = {"people": people_rows(), "form": form, "created": created, "roles": Role.choices}
    return render_page(request, "dashboard/people.html", context, status=status)


@role_required(PEOPLE_ROLE)
@require_POST
def person_edit(request: HttpRequest, pk: int) -> HttpResponseBase:
    person = get_object_or_404(User, pk=pk)
    form = PersonDetails(request.POST)
    if not form.is_valid():
        problems = "; ".join(f"{field}: {' '.join(errors)}" for field, errors in form.errors.items())
        return _person_answer(request, person.pk, f"{person.username} not changed: {problems}", status=400)
    changes = {**form.cleaned_data, "role": Role(form.cleaned_data["role"])}
    return _act(
        request,
        person,
        lambda actor: actions.update_user(actor, person, **changes),
        f"{person.username} saved.",
    )


@role_required(PEOPLE_ROLE)
@require_POST
def person_deactivate(request: HttpRequest, pk: int) -> HttpResponseBase:
    person = get_object_or_404(User, pk=pk)
    done = (
        f"{person.username} is deactivated: their logins, sessions, tokens and live pages are refused, and their "
        "API keys suspended."
    )
    return _act(request, person, lambda actor: actions.deactivate_user(actor, person), done)


@role_required(PEOPLE_ROLE)
@require_POST
def person_reactivate(request: HttpRequest, pk: int) -> HttpResponseBase:
    person = get_object_or_404(User, pk=pk)
    done = f"{person.username} is active again, with their role, password, tokens and API keys."
    return _act(request, person, lambda actor: actions.reactivate_user(actor, person), done)


@role_required(PEOPLE_ROLE)
@require_POST
def person_reset_password(request: HttpRequest, pk: int) -> HttpResponseBase:
    """A new generated password for another person, in the answer's note only (shown once)."""
    person = get_object_or_404(User, pk=pk)
    try:
        password = actions.reset_password(Actor.person(request.user), person)
    except Forbidden as exc:
        return _person_answer(request, person.pk, str(exc), status=400)
    note = f"{person.username}'s new password, shown this once: {password} (their sessions have ended)."
    return _person_answer(request, person.pk, note)


@login_required
@require_http_methods(["GET", "POST"])
def account_page(request: HttpRequest) -> HttpResponseBase:
    """One's own role, password change and tokens."""
    person = request.user
    assert isinstance(person, User)
    form = PasswordChange()
    status = 200
    if request.method == "POST":
        form = PasswordChange(request.POST)
        if form.submit(Actor.person(person), person, throttle.client_address(request)):
            update_session_auth_hash(request, person)  # this session stays; the others end
            messages.success(request, "Your password is changed; your other sessions have ended.")
            return redirect("dashboard:account")
        status = 400
    return render_page(request, "dashboard/account.html", {"form": form, **_own_tokens(person)}, status=status)


@role_required(TOKENS_ROLE)
@require_POST
def own_token_create(request: HttpRequest) -> HttpResponseBase:
    """Make a token for oneself. htmx: answered with the tokens section, the new key in it (shown once); else
    the whole Account page. A refusal comes back in the form, with a 400."""
    person = request.user
    assert isinstance(person, User)  # role_required let only people through
    form = OwnTokenForm(request.POST)
    made = form.submit(Actor.person(person), person)
    context = _own_tokens(person, form=form if made is None else None, created=made)
    status = 400 if made is None else 200
    if request.headers.get("HX-Request"):
        html = render_to_string("dashboard/partials/own_tokens.html", context, request=request)
        return HttpResponse(html, status=status)
    return render_page(request, "dashboard/account.html", {"form": PasswordChange(), **context}, status=status)


def _own_tokens(
    person: User, *, form: OwnTokenForm | None = None, created: tuple[ApiToken, str] | None = None
) -> dict[str, Any]:
    """What the Account page's tokens section shows: the person's tokens, the new-token form (to those who may
    make one; left out for the others, not hidden), and a token just made with its key."""
    can_make = person.has_role(TOKENS_ROLE)
    return {
        "tokens": ApiToken.objects.filter(kind=ApiToken.Kind.PERSON, user=person).order_by("created_at", "id"),
        "token_form": (form or OwnTokenForm()) if can_make else None,
        "created": created,
    }


@login_required
@require_POST
def own_token_revoke(request: HttpRequest, pk: int) -> HttpResponseBase:
    """Revoke one of one's own tokens (another's is a 404); the answer removes its row."""
    token = get_object_or_404(ApiToken, pk=pk, kind=ApiToken.Kind.PERSON, user=request.user)
    actions.revoke_token(Actor.person(request.user), token)
    note = f"Token {token.key_start}… is revoked: requests with it are refused from now on."
    if not request.headers.get("HX-Request"):
        messages.success(request, note)
        return redirect("dashboard:account")
    return HttpResponse(_flash(note, ok=True))


def _act(request: HttpRequest, person: User, action: Callable[[Actor], Any], done: str) -> HttpResponseBase:
    """Run ``action`` as the admin; answer with the person's fresh row and ``done``, or the refusal."""
    try:
        action(Actor.person(request.user))
    except Invalid as exc:
        return _person_answer(request, person.pk, exc.message, status=400)
    except Conflict as exc:
        return _person_answer(request, person.pk, str(exc), status=409)
    return _person_answer(request, person.pk, done)


def _person_answer(request: HttpRequest, pk: int, note: str, *, status: int = 200) -> HttpResponseBase:
    """The person's fresh row and ``note`` in the flash area; without htmx, the whole page with the note
    (not a redirect: a note may hold a password, which must not wait in the session)."""
    ok = status < 400
    if not request.headers.get("HX-Request"):
        context = {"people": people_rows(), "form": NewPersonForm(), "roles": Role.choices, "note": (note, ok)}
        return render_page(request, "dashboard/people.html", context, status=status)
    context = {"person": people_rows().get(pk=pk), "roles": Role.choices}
    html = render_to_string("dashboard/partials/person.html", context, request=request)
    return HttpResponse(html + _flash(note, ok=ok, out_of_band=True), status=status)


def _flash(note: str, *, ok: bool, out_of_band: bool = False) -> str:
    return render_to_string("dashboard/partials/flash.html", {"notes": [(note, ok)], "out_of_band": out_of_band})
