"""runtime/fleet_contract/api_keys.py: ``verify`` takes back exactly what ``sign`` made, and answers anything
else anyone could put in etcd (garbage, forgeries, records out of bounds) with BadRecord saying why, never
another exception: an ingress skips such a record and applies the others."""

import contextlib
import hashlib
import hmac
import random
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from runtime.errors import ConfigError
from runtime.fleet_contract.api_keys import BadRecord, KeyRecord, key_hash, read_secret, read_secrets, sign, verify

SECRET = b"s" * 64
HASHED = key_hash("sk-flt-a-fixed-key")  # fixed: test ids must be the same in every xdist worker


def signed(body: bytes) -> bytes:
    """``body`` under a valid signature, as ``sign`` signs a record's JSON: what only a holder of the secret
    (the control plane, or a bug in it) could put in etcd."""
    return hmac.new(SECRET, HASHED.encode() + b"\n" + body, hashlib.sha256).hexdigest().encode() + b"\n" + body


def fields(**changes: object) -> bytes:
    return msgspec.json.encode({"key_id": 1, "name": "chat-app", "owner": "alice", "version": 1, **changes})


BAD: dict[str, tuple[Callable[[], bytes], str]] = {
    "empty": (lambda: b"", "unsigned"),
    "no signature line": (lambda: fields(), "unsigned"),
    "a signature of non-ASCII bytes": (lambda: "é".encode() * 32 + b"\n" + fields(), "unsigned"),
    "a signature of 64 non-hex ASCII": (lambda: b"z" * 64 + b"\n" + fields(), "unsigned"),
    "a signature in upper case": (
        lambda: sign(KeyRecord(key_id=1, name="x", owner="y"), HASHED, SECRET).upper(),
        "unsigned",
    ),
    "a short signature": (lambda: b"ab\n" + fields(), "unsigned"),
    "invalid UTF-8 everywhere": (lambda: b"\xff\xfe\n\x80" * 100, "unsigned"),
    "a forged signature": (lambda: sign(KeyRecord(key_id=1, name="x", owner="y"), HASHED, b"f" * 64), "signature"),
    "not JSON": (lambda: signed(b"not json"), "malformed"),
    "a JSON array": (lambda: signed(b"[1, 2]"), "malformed"),
    "a missing field": (lambda: signed(b'{"key_id": 1, "name": "chat-app"}'), "malformed"),
    "a wrong type": (lambda: signed(fields(key_id="one")), "malformed"),
    "a boolean for a number": (lambda: signed(fields(version=True)), "malformed"),
    "a negative version": (lambda: signed(fields(version=-1)), "malformed"),
    "a key id past 64 bits": (lambda: signed(fields(key_id=2**64)), "malformed"),
    "a limit past 63 bits": (lambda: signed(fields(requests_per_minute=2**63)), "malformed"),
    "an expiry past the year 9999": (lambda: signed(fields(expires_at=1e300)), "malformed"),
    "an expiry before the year 1": (lambda: signed(fields(expires_at=-1e300)), "malformed"),
    "a number out of JSON's range": (lambda: signed(fields()[:-1] + b', "expires_at": 1e999}'), "malformed"),
    "a huge name": (lambda: signed(fields(name="x" * 100_000)), "malformed"),
    "a name that is not UTF-8": (lambda: signed(b'{"key_id": 1, "name": "\xff", "owner": "b"}'), "malformed"),
    "too many models": (lambda: signed(fields(models=["m"] * 20_000)), "malformed"),
    "deep nesting": (lambda: signed(fields()[:-1] + b', "z": ' + b"[" * 10**6 + b"]" * 10**6 + b"}"), "malformed"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD)
def test_anything_but_a_signed_record_is_refused_with_bad_record_saying_why(case: str) -> None:
    make, reason = BAD[case]
    with pytest.raises(BadRecord) as refused:
        verify(make(), HASHED, SECRET)
    assert refused.value.reason == reason and str(refused.value)


@pytest.mark.parametrize("hashed", ["", "abc", "A" * 64, "é" * 64, "\udcff" * 64, HASHED + "0"])
def test_a_record_under_an_etcd_key_that_is_no_key_hash_is_refused(hashed: str) -> None:
    with pytest.raises(BadRecord, match="64 lowercase hex digits") as refused:
        verify(sign(KeyRecord(key_id=1, name="x", owner="y"), HASHED, SECRET), hashed, SECRET)
    assert refused.value.reason == "key"


def test_random_bytes_signed_or_not_raise_nothing_but_bad_record() -> None:
    chance = random.Random(39)  # seeded: a failure is reproducible
    for _ in range(3000):
        garbage = chance.randbytes(chance.randrange(200))
        for value in (garbage, signed(garbage), garbage.replace(b"\n", b"") + b"\n" + fields()):
            with contextlib.suppress(BadRecord):  # any other exception fails the test
                verify(value, HASHED, SECRET)


def test_what_the_control_plane_signs_comes_back_whole_even_at_the_bounds() -> None:
    record = KeyRecord(
        key_id=2**63 - 1,
        name="n" * 1000,
        owner="o" * 1000,
        models=["m" * 1000] * 100,
        expires_at=253402300799.0,
        requests_per_minute=0,
        tokens_per_minute=2**63 - 1,
        monthly_token_budget=10**15,
        revoked=True,
        suspended=True,
        version=2**63 - 1,
    )
    assert verify(sign(record, HASHED, SECRET), HASHED, SECRET) == record
    assert signed(msgspec.json.encode(record)) == sign(record, HASHED, SECRET)  # the helper above signs alike


def test_while_a_secret_is_rotated_a_record_signed_with_either_of_two_is_taken() -> None:
    record = KeyRecord(key_id=1, name="x", owner="y")
    old, new = SECRET, b"n" * 64
    for signer in (old, new):
        assert verify(sign(record, HASHED, signer), HASHED, (new, old)) == record
    with pytest.raises(BadRecord, match="signature"):
        verify(sign(record, HASHED, b"f" * 64), HASHED, (new, old))


def test_the_secret_file_holds_one_secret_a_line_and_the_first_signs(tmp_path: Path) -> None:
    path = tmp_path / "api-keys.secret"
    path.write_bytes(b"n" * 64 + b"\n\n  " + b"o" * 40 + b"  \n")
    assert read_secrets(path) == (b"n" * 64, b"o" * 40)
    assert read_secret(path) == b"n" * 64
    path.write_bytes(b"n" * 64 + b"\n\n" + b"o" * 20 + b"\n")  # a line cut short
    with pytest.raises(ConfigError, match=r"on line 3 of .* is 20 bytes; it needs 32 \(one secret per line\)"):
        read_secrets(path)
    path.write_bytes(b"\n \n")
    with pytest.raises(ConfigError, match="is empty"):
        read_secrets(path)
