"""``flotilla profile --upload``: hand a measured profile to the control plane, where the planner reads it.

The endpoint, agreed with the control plane: ``PUT {URL}/api/v1/models/{MODEL_ID}/profile/`` with the
profile JSON as the body and ``Authorization: Bearer TOKEN`` (an operator's API token). A PUT, since the
profile replaces the model's previous one whole; sending it twice leaves the same profile.
"""

import json
import re
from typing import Any
from urllib.parse import quote

import httpx

from runtime.errors import ConfigError, FlotillaError

#: How long one upload may take: the body is a few hundred bytes, so this is a dead control plane's bound.
TIMEOUT_S = 15.0
#: A model id as it goes into the path: the catalog's id (a number), or a name made of URL-safe characters.
_MODEL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class UploadFailed(FlotillaError):
    """The control plane could not be reached, or failed (5xx): trying again later may help."""


class UploadRefused(ConfigError):
    """The control plane refused the profile (4xx): a token, a model id or the profile itself to fix."""


def check_model_id(text: str) -> str:
    """``text`` as a model id; raises ConfigError for one that cannot be a path segment."""
    if not _MODEL_ID.fullmatch(text):
        raise ConfigError(f"{text!r} is not a model id: the catalog's id, e.g. 12 (letters, digits, '.', '_', '-')")
    return text


def profile_url(base_url: str, model_id: str) -> str:
    """Where the profile of model ``model_id`` is PUT."""
    return f"{base_url.rstrip('/')}/api/v1/models/{quote(model_id, safe='')}/profile/"


def upload_profile(
    base_url: str,
    model_id: str,
    token: str,
    document: dict[str, Any],
    *,
    transport: httpx.BaseTransport | None = None,
) -> int:
    """PUT ``document`` as model ``model_id``'s profile; returns the answer's status (2xx).

    Raises UploadRefused for a 4xx answer (its reason in the message), UploadFailed for no answer or a 5xx.
    """
    url = profile_url(base_url, model_id)
    try:
        with httpx.Client(timeout=TIMEOUT_S, transport=transport) as client:
            response = client.put(
                url,
                content=json.dumps(document).encode(),
                headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
            )
    except httpx.HTTPError as exc:
        raise UploadFailed(f"could not upload the profile to {url}: {exc or type(exc).__name__}") from exc
    status = response.status_code
    if status < 300:
        return status
    said = _reason(response)
    if status in (401, 403):
        raise UploadRefused(f"the control plane refused the token ({status}) at {url}: {said}")
    if status == 404:
        raise UploadRefused(f"the control plane has no model {model_id!r} (404 at {url}): {said}")
    if status < 500:
        raise UploadRefused(f"the control plane refused the profile ({status} at {url}): {said}")
    raise UploadFailed(f"the control plane failed to store the profile ({status} at {url}): {said}")


def _reason(response: httpx.Response) -> str:
    """The answer's body, short: DRF's error object, or the first of its text."""
    text = response.text.strip()
    return text[:500] + ("..." if len(text) > 500 else "") if text else "(no body)"
