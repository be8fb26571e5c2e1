"""frontend_gateway/access/api_keys.py: the ingress believes only key records the control plane signed, never
an older one than it has seen, skips (and counts) any other record while the rest apply, and answers
missing, wrong, revoked, suspended, expired and out-of-scope keys as OpenAI does."""

import logging
from collections.abc import Callable

import pytest

from frontend_gateway.access.api_keys import InvalidApiKey, KeyTable, ModelNotAllowed, check_model
from runtime.cluster.discovery import WatchEvent
from runtime.fleet_contract import batch_credentials
from runtime.fleet_contract.api_keys import KeyRecord, etcd_key, key_hash, new_key, sign

SECRET = b"s" * 64
NOW = 1_800_000_000.0


def published(key: str, record: KeyRecord, secret: bytes = SECRET) -> WatchEvent:
    hashed = key_hash(key)
    return WatchEvent("put", etcd_key(hashed), sign(record, hashed, secret))


def record(**fields: object) -> KeyRecord:
    return KeyRecord(**{"key_id": 1, "name": "chat-app", "owner": "alice", "version": 1, **fields})  # type: ignore[arg-type]


@pytest.fixture
def table() -> KeyTable:
    return KeyTable(SECRET, clock=lambda: NOW)


def bearer(key: str) -> bytes:
    return f"Bearer {key}".encode()


def test_a_published_key_is_known_and_the_record_says_what_it_may_use(table: KeyTable) -> None:
    key = new_key()
    table.apply(published(key, record(models=["smol"])))
    found = table.check(bearer(key))
    assert found.name == "chat-app" and len(table) == 1
    check_model(found, "smol")
    with pytest.raises(ModelNotAllowed, match="'chat-app' may not use the model 'big'") as refused:
        check_model(found, "big")
    assert (refused.value.status, refused.value.code) == (403, "model_not_allowed")


@pytest.mark.parametrize("header", [None, b"", b"Bearer", b"Bearer   ", b"Basic dXNlcjpwYXNz", b"sk-flt-x"])
def test_a_missing_key_is_a_401_that_says_how_to_send_one(table: KeyTable, header: bytes | None) -> None:
    with pytest.raises(InvalidApiKey, match="You didn't provide an API key") as refused:
        table.check(header)
    assert (refused.value.status, refused.value.code) == (401, "invalid_api_key")


def test_an_unknown_key_is_a_401_that_shows_only_its_ends(table: KeyTable) -> None:
    key = new_key()
    with pytest.raises(InvalidApiKey, match="Incorrect API key provided") as refused:
        table.check(bearer(key))
    assert key not in refused.value.message and key[-4:] in refused.value.message


def test_revoked_and_expired_keys_are_refused_saying_so(table: KeyTable) -> None:
    revoked, expired = new_key(), new_key()
    table.apply(published(revoked, record(version=1)))
    table.apply(published(revoked, record(version=2, revoked=True)))
    table.apply(published(expired, record(key_id=2, expires_at=NOW - 1)))
    with pytest.raises(InvalidApiKey, match="was revoked"):
        table.check(bearer(revoked))
    with pytest.raises(InvalidApiKey, match="expired at 2027-01-15"):
        table.check(bearer(expired))
    assert len(table) == 1  # the expired one is still a key; the revoked one is not


def test_a_record_not_signed_by_the_control_plane_is_ignored_and_logged(
    table: KeyTable, caplog: pytest.LogCaptureFixture
) -> None:
    key = new_key()
    with caplog.at_level(logging.WARNING, "frontend_gateway.access.api_keys"):
        table.apply(published(key, record(), secret=b"f" * 64))  # forged with another secret
        hashed = key_hash(key)
        good = sign(record(), hashed, SECRET)
        table.apply(WatchEvent("put", etcd_key(key_hash(new_key())), good))  # a real record moved to a new key
    with pytest.raises(InvalidApiKey, match="Incorrect API key"):
        table.check(bearer(key))
    assert len(table) == 0 and "signature does not match" in caplog.text


def test_an_older_record_put_back_does_not_revive_a_revoked_key(table: KeyTable) -> None:
    key = new_key()
    first = published(key, record(version=1))
    table.apply(first)
    table.apply(published(key, record(version=2, revoked=True)))
    table.apply(first)  # a copy of the active record, replayed by whoever kept it
    with pytest.raises(InvalidApiKey, match="was revoked"):
        table.check(bearer(key))
    table.apply(WatchEvent("delete", first.key))
    table.apply(first)  # not even after its record was deleted
    with pytest.raises(InvalidApiKey):
        table.check(bearer(key))


def test_a_malformed_record_is_skipped_logged_and_counted_while_the_others_apply(
    caplog: pytest.LogCaptureFixture,
) -> None:
    skipped: list[str] = []
    table = KeyTable(SECRET, clock=lambda: NOW, on_skipped=skipped.append)
    good, revoked = new_key(), new_key()
    table.apply(published(good, record(key_id=1)))
    table.apply(published(revoked, record(key_id=2, version=1)))
    forged = etcd_key(key_hash(new_key()))
    with caplog.at_level(logging.WARNING, "frontend_gateway.access.api_keys"):
        # A signature of non-ASCII bytes once raised TypeError out of apply(), and the watch with it.
        table.apply(WatchEvent("put", forged, "é".encode() * 32 + b"\n{}"))
        table.apply(WatchEvent("put", etcd_key("not-a-hash"), b"garbage"))
        table.apply(published(revoked, record(key_id=2, version=2, revoked=True)))  # still applies
        table.apply(published(revoked, record(key_id=2, version=1)))  # a replay: skipped too
    assert skipped == ["unsigned", "key", "older"]
    assert table.check(bearer(good)).key_id == 1
    with pytest.raises(InvalidApiKey, match="was revoked"):
        table.check(bearer(revoked))
    # The first line names the record and says why; the rest within the minute are counted in the next one.
    (line,) = [r.getMessage() for r in caplog.records]
    assert forged in line and "not a signed key record" in line


def test_a_skipped_record_leaves_the_last_good_one_in_place(table: KeyTable) -> None:
    key = new_key()
    table.apply(published(key, record(version=2, revoked=True)))
    table.apply(WatchEvent("put", etcd_key(key_hash(key)), b"\xff" * 64 + b"\n{}"))  # the revocation overwritten
    with pytest.raises(InvalidApiKey, match="was revoked"):
        table.check(bearer(key))


def test_a_suspended_key_is_a_401_that_says_its_owner_is_deactivated(table: KeyTable) -> None:
    key = new_key()
    table.apply(published(key, record(version=1)))
    table.apply(published(key, record(version=2, revoked=True, suspended=True)))
    with pytest.raises(InvalidApiKey, match="is suspended: its owner's account is deactivated") as refused:
        table.check(bearer(key))
    assert (refused.value.status, len(table)) == (401, 0)
    table.apply(published(key, record(version=3)))  # the owner reactivated
    assert table.check(bearer(key)).name == "chat-app"


class Listed:
    """What ``KeyTable.load`` asks of etcd: the records under the prefix, here given."""

    def __init__(self, *events: WatchEvent) -> None:
        self.values = {event.key: event.value or b"" for event in events}

    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        return self.values


async def test_a_record_skipped_for_a_secret_not_known_yet_applies_once_the_secret_is(table: KeyTable) -> None:
    key, new = new_key(), b"n" * 64
    # The control plane signed with the new secret before this ingress was given it.
    await table.load(Listed(published(key, record(), secret=new)))  # type: ignore[arg-type]
    with pytest.raises(InvalidApiKey, match="Incorrect API key"):
        table.check(bearer(key))

    assert table.set_secrets([SECRET, new])
    assert table.check(bearer(key)).name == "chat-app"
    assert not table.set_secrets([SECRET, new])  # the same secrets: nothing to do


def altered_last_digit(header: bytes) -> bytes:
    """The header with the signature's last hex digit changed (to another one, whatever it was)."""
    return header[:-1] + (b"1" if header.endswith(b"0") else b"0")


def batch_credential(key: str, *, expires_at: float = NOW + 60, secret: bytes = SECRET) -> bytes:
    return bearer(batch_credentials.sign(key_hash(key), "batch_abc123", int(expires_at), secret))


def test_a_batchs_credential_is_its_keys_own_while_the_key_works() -> None:
    """The control plane sends a batch's requests with a credential for the key that made it
    (runtime/fleet_contract/batch_credentials.py): the key's record applies, and a revoked key stops it."""
    table = KeyTable([b"o" * 64, SECRET], clock=lambda: NOW)  # any secret of a rotation signs it
    key = new_key()
    table.apply(published(key, record(models=["smol"])))
    assert table.check(batch_credential(key)).models == ["smol"]

    table.apply(published(key, record(version=2, revoked=True)))
    with pytest.raises(InvalidApiKey, match=r"The API key of batch_abc123 .* was revoked"):
        table.check(batch_credential(key))


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda key: batch_credential(key, secret=b"x" * 64), "signature does not match"),
        (lambda key: batch_credential(key, expires_at=NOW - 1), "credential of batch_abc123 has expired"),
        (lambda key: altered_last_digit(batch_credential(key)), "signature does not match"),
        (lambda key: batch_credential(key).replace(b"batch_abc123", b"batch_other1"), "signature does not match"),
        (lambda key: b"Bearer flt-batch.not-one", "not in the control plane's form"),
        (lambda key: batch_credential(new_key()), "Incorrect API key provided: of batch_abc123"),
    ],
)
def test_a_forged_altered_or_expired_batch_credential_is_a_401(make: Callable[[str], bytes], why: str) -> None:
    table = KeyTable(SECRET, clock=lambda: NOW)
    key = new_key()
    table.apply(published(key, record()))
    with pytest.raises(InvalidApiKey, match=why) as refused:
        table.check(make(key))
    assert (refused.value.status, refused.value.code) == (401, "invalid_api_key")
