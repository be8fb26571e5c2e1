"""API keys on the ingress: who may call ``/v1/*``, and with which models.

``KeyTable`` holds the keys the control plane published in etcd (``runtime/fleet_contract/api_keys.py``), kept current
by a watch, so that checking a request costs one SHA-256 and one dict lookup, with no round trip. A
revocation takes effect when its watch event arrives (milliseconds after the control plane's commit);
while etcd is unreachable the table keeps what it had, and the watch, once back, lists the prefix again
and applies the differences.

A record that is not one the control plane signed (forged, altered, garbage, out of bounds) is skipped,
logged (at most once a minute, naming its etcd key and what is wrong) and counted (``on_skipped``: the
gateway's ``flotilla_frontend_api_key_records_skipped_total``), and every other record still applies: one
bad record must not stop revocations, nor an ingress from starting. A skipped record changes nothing: the
key keeps the last good record it had (a revoked key stays revoked) until the control plane's sync puts
its record back.

The secrets a record may be signed with can change while the ingress runs (``set_secrets``, from the file
that ``secret_file.py`` re-reads): during a rotation the old one and the new are both accepted, and the
records seen in etcd are applied again, so one skipped for a secret not yet known here takes effect.

Answers are OpenAI's: 401 ``invalid_api_key`` for a missing, unknown, revoked, suspended (its owner is
deactivated) or expired key, 403 ``model_not_allowed`` for a model outside the key's list.
"""

import logging
import time
from collections.abc import Callable, Sequence
from http import HTTPStatus

from frontend_gateway.errors import GatewayError
from runtime.cluster.discovery import Discovery, WatchEvent
from runtime.fleet_contract import batch_credentials
from runtime.fleet_contract.api_keys import API_KEYS_PREFIX, BadRecord, KeyRecord, key_hash, verify
from runtime.rate_limited_log import RateLimitedLog

log = logging.getLogger(__name__)

_MISSING = (
    "You didn't provide an API key. Send it in an Authorization header using Bearer auth (Authorization: "
    "Bearer sk-flt-...); an operator makes one in the control plane (dashboard, or POST /api/v1/api-keys/)."
)


class InvalidApiKey(GatewayError):
    """No key, or one that does not work (401)."""

    status = HTTPStatus.UNAUTHORIZED
    error_type = "invalid_request_error"
    code = "invalid_api_key"


class ModelNotAllowed(GatewayError):
    """The key may not use the model asked for (403)."""

    status = HTTPStatus.FORBIDDEN
    error_type = "invalid_request_error"
    code = "model_not_allowed"


class KeyTable:
    """The published keys by hash; ``check`` answers for a request's ``Authorization`` header."""

    def __init__(
        self,
        secrets: bytes | Sequence[bytes],
        *,
        clock: Callable[[], float] = time.time,
        on_skipped: Callable[[str], None] | None = None,
    ) -> None:
        self._secrets = (secrets,) if isinstance(secrets, bytes) else tuple(secrets)
        self._clock = clock
        #: Told the reason (BadRecord.reason, or "older") of every record skipped, for a metric.
        self._on_skipped = on_skipped
        self._keys: dict[str, KeyRecord] = {}
        #: The highest version seen per key hash, revoked ones included: an older record is a replay.
        self._versions: dict[str, int] = {}
        self._refused = RateLimitedLog(log, period_s=60.0)
        self._seen: dict[str, bytes] = {}  # etcd key -> the value last applied, for the watch to resume from

    @property
    def secrets(self) -> tuple[bytes, ...]:
        return self._secrets

    def set_secrets(self, secrets: Sequence[bytes]) -> bool:
        """Accept records signed with ``secrets`` from now on; returns whether they changed. The records
        seen in etcd are applied again: one skipped for a secret this table did not know yet takes effect
        (a record signed only with a secret no longer accepted is skipped from now on; what it set stays,
        until the control plane's sync re-signs it)."""
        secrets = tuple(secrets)
        if secrets == self._secrets:
            return False
        self._secrets = secrets
        for key, value in list(self._seen.items()):
            self.apply(WatchEvent("put", key, value))
        return True

    def __len__(self) -> int:
        return sum(not record.revoked for record in self._keys.values())

    async def load(self, discovery: Discovery) -> None:
        """Apply the records in etcd now (before serving, so that the first requests find their keys).
        Raises DiscoveryUnavailable when etcd does not answer."""
        for key, value in (await discovery.get_prefix(API_KEYS_PREFIX)).items():
            self.apply(WatchEvent("put", key, value))
            self._seen[key] = value

    async def run(self, discovery: Discovery) -> None:
        """Apply etcd's changes until cancelled (the watch survives etcd outages, and resumes from what
        this table has seen, so a restarted run repeats nothing)."""
        async for event in discovery.watch_prefix(API_KEYS_PREFIX, known=self._seen):
            self.apply(event)
            if event.kind == "put" and event.value is not None:
                self._seen[event.key] = event.value
            else:
                self._seen.pop(event.key, None)

    def apply(self, event: WatchEvent) -> None:
        hashed = event.key.removeprefix(API_KEYS_PREFIX)
        if event.kind == "delete":
            # The control plane deletes only records of keys it no longer has; the key stops working.
            self._keys.pop(hashed, None)
            return
        assert event.value is not None
        try:
            record = verify(event.value, hashed, self._secrets)
        except BadRecord as exc:
            self._skip(exc.reason, f"API keys: skipped the record at {_shown_key(event.key)}: {exc}")
            return
        if record.version < self._versions.get(hashed, 0):
            self._skip(
                "older",
                f"API keys: skipped an older record (version {record.version}) of key {record.name!r} at "
                f"{_shown_key(event.key)}: it has version {self._versions[hashed]}",
            )
            return
        self._versions[hashed] = record.version
        self._keys[hashed] = record

    def _skip(self, reason: str, message: str) -> None:
        self._refused.warning(message)
        if self._on_skipped is not None:
            self._on_skipped(reason)

    def check(self, authorization: bytes | None) -> KeyRecord:
        """The key of an ``Authorization: Bearer …`` header. Raises InvalidApiKey saying what is wrong."""
        if not authorization:
            raise InvalidApiKey(_MISSING)
        scheme, _, token = authorization.decode("latin-1").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise InvalidApiKey(_MISSING)
        if token.startswith(batch_credentials.PREFIX):
            return self._check_batch_credential(token)
        return self._check_record(self._keys.get(key_hash(token)), _shown(token))

    def _check_batch_credential(self, token: str) -> KeyRecord:
        """The key a batch's request runs for (``runtime/fleet_contract/batch_credentials.py``), checked as
        the key itself would be: a key revoked or expired since the batch began stops it."""
        try:
            credential = batch_credentials.verify(token, self._secrets, self._clock())
        except batch_credentials.BadCredential as exc:
            raise InvalidApiKey(f"Incorrect API key provided: {exc}.") from None
        return self._check_record(self._keys.get(credential.key_hash), f"of {credential.batch_id}")

    def _check_record(self, record: KeyRecord | None, shown: str) -> KeyRecord:
        if record is None:
            raise InvalidApiKey(f"Incorrect API key provided: {shown}. Check it, or ask an operator for a new one.")
        if record.suspended:
            raise InvalidApiKey(
                f"The API key {shown} ({record.name!r}) is suspended: its owner's account is deactivated."
            )
        if record.revoked:
            raise InvalidApiKey(f"The API key {shown} ({record.name!r}) was revoked. Ask an operator for a new one.")
        if record.expires_at is not None and record.expires_at <= self._clock():
            when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(record.expires_at))
            raise InvalidApiKey(f"The API key {shown} ({record.name!r}) expired at {when}. Ask for a new one.")
        return record


def check_model(record: KeyRecord, model: str) -> None:
    """Raise ModelNotAllowed unless ``record`` may use ``model`` (named as the request named it)."""
    if not record.allows_model(model):
        shown = model if len(model) <= 200 else model[:200] + "..."
        raise ModelNotAllowed(f"The API key {record.name!r} may not use the model {shown!r}.", param="model")


def _shown_key(key: str) -> str:
    """An etcd key as log lines show it: escaped, and cut short (a forged one may be anything, of any size)."""
    shown = ascii(key)
    return shown if len(shown) <= 120 else shown[:120] + "..."


def _shown(token: str) -> str:
    """A key as error messages show it: its start and end only (as OpenAI's do)."""
    return f"{token[:10]}***{token[-4:]}" if len(token) > 16 else "***"
