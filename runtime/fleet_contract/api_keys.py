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
"""

import hashlib
import hmac
import os
import secrets
from pathlib import Path

import msgspec

from runtime.errors import ConfigError

API_KEYS_PREFIX = "flotilla/api-keys/"
KEY_PREFIX = "sk-flt-"
SECRET_FILE_VARIABLE = "FLOTILLA_API_KEYS_SECRET_FILE"
_SIGNATURE_BYTES = 64  # hex of a SHA-256 HMAC
_MIN_SECRET_BYTES = 32


class KeyRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What an ingress knows of a key: who it is, what it may use, and its limits."""

    key_id: int
    name: str
    owner: str
    #: Served model names it may use; None: every model.
    models: list[str] | None = None
    #: Unix time after which it is refused; None: never.
    expires_at: float | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    monthly_token_budget: int | None = None
    revoked: bool = False
    #: Grows with every record published for the key: an ingress ignores one older than what it has.
    version: int = 0

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
    return _mac(secret, hashed, body).encode() + b"\n" + body


class BadRecord(Exception):
    """An etcd value that is not a record signed with our secret for that key."""


def verify(value: bytes, hashed: str, secret: bytes) -> KeyRecord:
    """The record in ``value`` (from ``sign``) for the key whose hash is ``hashed``. Raises BadRecord."""
    signature, newline, body = value.partition(b"\n")
    if not newline or len(signature) != _SIGNATURE_BYTES:
        raise BadRecord("not a signed key record")
    if not hmac.compare_digest(signature.decode(errors="replace"), _mac(secret, hashed, body)):
        raise BadRecord("its signature does not match (signed with another secret, or altered)")
    try:
        return msgspec.json.decode(body, type=KeyRecord)
    except msgspec.DecodeError as exc:
        raise BadRecord(f"malformed: {exc}") from exc


def _mac(secret: bytes, hashed: str, body: bytes) -> str:
    return hmac.new(secret, hashed.encode() + b"\n" + body, hashlib.sha256).hexdigest()


def read_secret(path: Path) -> bytes:
    """The signing secret in ``path``. Raises ConfigError saying what is wrong and what to do."""
    try:
        secret = path.read_bytes().strip()
    except OSError as exc:
        raise ConfigError(
            f"cannot read the API keys' signing secret {path} ({exc.strerror}); it is the control plane's "
            f"(its data directory's api-keys.secret): copy it to this machine, readable by this user only"
        ) from exc
    if len(secret) < _MIN_SECRET_BYTES:
        raise ConfigError(f"the API keys' signing secret {path} is {len(secret)} bytes; it needs {_MIN_SECRET_BYTES}")
    return secret


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
