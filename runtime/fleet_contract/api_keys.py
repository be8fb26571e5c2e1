"""API keys for the OpenAI endpoint, as the control plane publishes them to the ingress processes.

A key (``sk-flt-…``) is shown once when it is created and stored nowhere: the control plane keeps its
SHA-256, and publishes one record per key in etcd under ``flotilla/api-keys/<sha256>``. Every ingress
watches that prefix, so a request's key is checked with one hash and one dict lookup, and a revocation
reaches every ingress as fast as an etcd watch event (milliseconds).

Records are signed (HMAC-SHA256 with a secret only the control plane and the ingress processes hold,
``FLOTILLA_API_KEYS_SECRET_FILE``): workers can write to etcd too, and one must not be able to mint a key.
A revoked key's record is replaced by a signed tombstone with a higher ``version``, and an ingress never
takes a record older than one it has seen for that key, so an old "active" record put back by someone
who kept a copy does not bring a revoked key back to that ingress; the control plane's periodic sync
rewrites every record from its database, which undoes such a replay in etcd itself.

The secret file holds one secret per line: the control plane signs with the first, an ingress accepts a
record signed with any (and re-reads the file while it runs), so the secret is rotated without a refused
request: the new one is added to every ingress's file, then put first in the control plane's (whose sync
re-signs every record with it), then the old one is removed (docs/controlplane.md says how).

A key whose owner is deactivated is published as revoked with ``suspended`` set (and a higher version);
reactivating the owner publishes it active again, with a higher version still.

Anything else under the prefix is refused by ``verify`` with BadRecord saying why, whatever its bytes: an
ingress skips such a record and applies the others (``frontend_gateway/access/api_keys.py``).
"""

import hashlib
import hmac
import os
import re
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import msgspec

from runtime.errors import ConfigError

API_KEYS_PREFIX = "flotilla/api-keys/"
KEY_PREFIX = "sk-flt-"
SECRET_FILE_VARIABLE = "FLOTILLA_API_KEYS_SECRET_FILE"
_SIGNATURE_BYTES = 64  # hex of a SHA-256 HMAC
_MIN_SECRET_BYTES = 32
_HEX_DIGEST = re.compile(rb"[0-9a-f]{64}")

# Bounds on what a record may say: wide enough for anything the control plane stores (its own limits are
# far tighter), narrow enough that no value can overflow what the ingress does with it (time.gmtime for an
# expiry, Redis's 64-bit counters for limits) or flood its log with a name.
_MAX_INT = 2**63 - 1
_Count = Annotated[int, msgspec.Meta(ge=0, le=_MAX_INT)]
_Text = Annotated[str, msgspec.Meta(max_length=1000)]
#: Unix times of the years 1 to 9999, the range of Python's datetime (and Django's DateTimeField).
_Time = Annotated[float, msgspec.Meta(ge=-62135596800.0, le=253402300799.0)]


class KeyRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What an ingress knows of a key: who it is, what it may use, and its limits."""

    key_id: _Count
    name: _Text
    owner: _Text
    #: Served model names it may use; None: every model.
    models: Annotated[list[_Text], msgspec.Meta(max_length=10_000)] | None = None
    #: Unix time after which it is refused; None: never.
    expires_at: _Time | None = None
    requests_per_minute: _Count | None = None
    tokens_per_minute: _Count | None = None
    monthly_token_budget: _Count | None = None
    #: Requests of this key one ingress process serves at once; None: the process's default, if any.
    max_concurrent_requests: _Count | None = None
    revoked: bool = False
    #: Revoked for now because its owner is deactivated (``revoked`` is set too, so that an ingress that
    #: does not know this field refuses the key as well); it works again when the owner is reactivated.
    suspended: bool = False
    #: Grows with every record published for the key: an ingress ignores one older than what it has.
    version: _Count = 0

    def allows_model(self, model: str) -> bool:
        return self.models is None or model in self.models


def new_key() -> str:
    """A new secret key: ``sk-flt-`` and 43 URL-safe characters (256 random bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_hash(key: str) -> str:
    """The stored and published form of a key: its SHA-256 in hex (keys are random: no salt is needed)."""
    return hashlib.sha256(key.encode()).hexdigest()


def etcd_key(hashed: str) -> str:
    return API_KEYS_PREFIX + hashed


def sign(record: KeyRecord, hashed: str, secret: bytes) -> bytes:
    """The etcd value of ``record`` for the key whose hash is ``hashed``: its signature, a newline, its JSON.

    The signature covers the key's hash too, so a record cannot be moved to another key."""
    body = msgspec.json.encode(record)
    return _mac(secret, hashed, body) + b"\n" + body


class BadRecord(Exception):
    """An etcd value that is not a record signed with our secret for that key; ``reason`` is a short
    label of what is wrong (for a metric), the message says it in words."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def verify(value: bytes, hashed: str, secret: bytes | Sequence[bytes]) -> KeyRecord:
    """The record in ``value`` (from ``sign``) for the key whose hash is ``hashed``, signed with ``secret``
    (or with any of several: while the secret is rotated, the old one and the new).

    Raises BadRecord, and nothing else, for any other bytes: the values under the prefix are anyone's who
    can write to etcd."""
    # Compared as bytes throughout: hmac.compare_digest refuses str with non-ASCII characters (TypeError).
    if _HEX_DIGEST.fullmatch(hashed.encode(errors="replace")) is None:
        raise BadRecord("key", "its etcd key does not end in a key's SHA-256 (64 lowercase hex digits)")
    signature, newline, body = value.partition(b"\n")
    if not newline:
        raise BadRecord("unsigned", "not a signed key record (no signature line)")
    if _HEX_DIGEST.fullmatch(signature) is None:
        raise BadRecord("unsigned", "not a signed key record (its signature is not 64 lowercase hex digits)")
    accepted = (secret,) if isinstance(secret, bytes) else secret
    if not any(hmac.compare_digest(signature, _mac(key, hashed, body)) for key in accepted):
        raise BadRecord("signature", "its signature does not match (signed with another secret, or altered)")
    try:
        return msgspec.json.decode(body, type=KeyRecord)
    # msgspec's DecodeError and ValidationError (a wrong type, a missing field, a bound) are ValueErrors;
    # so is the UnicodeDecodeError of a string that is not UTF-8; deep nesting is a RecursionError.
    except (ValueError, RecursionError) as exc:
        raise BadRecord("malformed", f"malformed: {exc}") from exc


def _mac(secret: bytes, hashed: str, body: bytes) -> bytes:
    return hmac.new(secret, hashed.encode() + b"\n" + body, hashlib.sha256).hexdigest().encode()


def read_secret(path: Path) -> bytes:
    """The secret to sign with: the first in ``path``. Raises ConfigError saying what is wrong and what to do."""
    return read_secrets(path)[0]


def read_secrets(path: Path) -> tuple[bytes, ...]:
    """The secrets in ``path``, one per line (blank lines aside), the signing one first. Raises ConfigError
    saying what is wrong and what to do."""
    try:
        content = path.read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"cannot read the API keys' signing secret {path} ({exc.strerror}); it is the control plane's "
            f"(its data directory's api-keys.secret): copy it to this machine, readable by this user only"
        ) from exc
    found: list[bytes] = []
    for number, line in enumerate(content.splitlines(), start=1):
        if not (secret := line.strip()):
            continue
        if len(secret) < _MIN_SECRET_BYTES:
            raise ConfigError(
                f"the API keys' signing secret on line {number} of {path} is {len(secret)} bytes; it needs "
                f"{_MIN_SECRET_BYTES} (one secret per line)"
            )
        found.append(secret)
    if not found:
        raise ConfigError(f"the API keys' signing secret {path} is empty; it needs {_MIN_SECRET_BYTES} bytes or more")
    return tuple(found)


def secret_in(directory: Path) -> Path:
    """The control plane's signing secret in ``directory`` (``api-keys.secret``), made (0600) if missing."""
    path = directory / "api-keys.secret"
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return path  # another process made it first
        with os.fdopen(fd, "w") as file:
            file.write(secrets.token_hex(32) + "\n")
    return path
