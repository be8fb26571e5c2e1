"""The credential a batch's requests carry: the control plane acting for the key that made the batch.

The control plane keeps no API key, only its SHA-256, so a batch it runs (``/v1/batches``) cannot send its
requests with the key itself. It sends them with a credential it signs with the API keys' secret (the one
that signs the key records the ingresses hold, ``api_keys.py``): the key's hash, the batch's id and an
expiry. An ingress that checks it (``frontend_gateway/access/api_keys.py``) then treats the request as the
key's own: the key's models, limits and usage, and a key revoked or expired since is refused here too, so
revoking a key stops its batches. The credential names one batch and lapses: a copy seen in a log is
worth one batch's window, not the key.

Form: ``flt-batch.<key sha256>.<batch id>.<expires, unix s>.<HMAC-SHA256 hex of the rest>``.
"""

import hashlib
import hmac
import re
from collections.abc import Sequence
from typing import NamedTuple

PREFIX = "flt-batch."
_FORM = re.compile(r"flt-batch\.([0-9a-f]{64})\.(batch_[0-9A-Za-z]{1,64})\.([0-9]{1,12})\.([0-9a-f]{64})")


class BatchCredential(NamedTuple):
    key_hash: str
    batch_id: str
    expires_at: int


class BadCredential(Exception):
    """Not a credential the control plane signed, or one past its expiry; the message says which."""


def sign(key_hash: str, batch_id: str, expires_at: int, secret: bytes) -> str:
    """The credential for ``batch_id``'s requests, sent for the key whose hash is ``key_hash``."""
    body = f"{PREFIX}{key_hash}.{batch_id}.{expires_at}"
    credential = f"{body}.{_mac(secret, body)}"
    if _FORM.fullmatch(credential) is None:
        raise ValueError(f"cannot sign a batch credential for key hash {key_hash!r} and batch {batch_id!r}")
    return credential


def verify(token: str, secrets: Sequence[bytes], now: float) -> BatchCredential:
    """The credential in ``token``, signed with one of ``secrets`` and not expired at ``now``. Raises
    BadCredential saying what is wrong (the token's bytes are anyone's)."""
    match = _FORM.fullmatch(token)
    if match is None:
        raise BadCredential("a batch credential that is not in the control plane's form")
    hashed, batch_id, expires, signature = match.groups()
    body = token[: -len(signature) - 1]
    if not any(hmac.compare_digest(signature, _mac(secret, body)) for secret in secrets):
        raise BadCredential("a batch credential whose signature does not match")
    if int(expires) <= now:
        raise BadCredential(f"the credential of {batch_id} has expired")
    return BatchCredential(hashed, batch_id, int(expires))


def _mac(secret: bytes, body: str) -> str:
    return hmac.new(secret, b"batch-credential\n" + body.encode(), hashlib.sha256).hexdigest()
