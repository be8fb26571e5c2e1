"""Signed fleet tasks: an HMAC-SHA256 per task, with a key only the control plane and one node's agent hold.

Every agent holds the broker's credentials, so a message on queue ``node.<name>`` proves nothing about who
wrote it. The control plane therefore signs each task it sends (``sign_payload``) and the agent acts only
on a task signed for its node (``signature_ok``). The key is derived from the node's agent token, which
both sides can compute from what they hold: the agent has the token, the control plane keeps only its
SHA-256 (``token_digest``; controlplane/accounts' ``hash_token``), so the key is an HMAC of the node's
name under that digest (``signing_key``). docs/architecture.md says what this protects and what not.

A node may have several tokens (one being replaced): a task carries one signature per token of its node,
each under a short key id, and the agent checks the one of its own key. The signature covers the task's
name and its JSON payload as sent, less the ``signatures`` field, in a canonical form (keys sorted, no
spaces), so it is checked before the payload is decoded: a signed payload the agent cannot decode is
still known to come from the control plane, and is reported; an unsigned one is only logged.
"""

import hashlib
import hmac
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

#: The field of a task's payload that carries its signatures: key id -> hex HMAC-SHA256.
SIGNATURES_FIELD = "signatures"
_KEY_CONTEXT = b"flotilla fleet task signing key v1\n"
_KEY_ID_CONTEXT = b"flotilla fleet task key id v1\n"


@dataclass(frozen=True, repr=False)
class SigningKey:
    """One node's task-signing key, and the id that names it in a task's signatures (not secret)."""

    key_id: str
    secret: bytes

    def __repr__(self) -> str:
        return f"SigningKey(key_id={self.key_id!r})"  # never the secret, in a log or a traceback


def token_digest(token: str) -> str:
    """What the control plane stores of an agent token: its SHA-256, in hex."""
    return hashlib.sha256(token.encode()).hexdigest()


def signing_key(digest: str, node: str) -> SigningKey:
    """Node ``node``'s key from its agent token's ``digest`` (``token_digest``). Raises ValueError for a
    digest that is not hex."""
    secret = hmac.new(bytes.fromhex(digest), _KEY_CONTEXT + node.encode(), hashlib.sha256).digest()
    key_id = hashlib.sha256(_KEY_ID_CONTEXT + secret).hexdigest()[:16]
    return SigningKey(key_id, secret)


def agent_signing_key(token: str, node: str) -> SigningKey:
    """The key of the agent of node ``node`` whose token is ``token``."""
    return signing_key(token_digest(token), node)


def _signed_bytes(task: str, payload: Mapping[str, object]) -> bytes:
    body = {key: value for key, value in payload.items() if key != SIGNATURES_FIELD}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return task.encode() + b"\n" + canonical.encode()


def _signature(key: SigningKey, task: str, payload: Mapping[str, object]) -> str:
    return hmac.new(key.secret, _signed_bytes(task, payload), hashlib.sha256).hexdigest()


def sign_payload(task: str, payload: Mapping[str, object], keys: Iterable[SigningKey]) -> dict[str, object]:
    """``payload`` (task ``task``'s JSON argument, an object) with one signature per key in ``keys``."""
    signatures = {key.key_id: _signature(key, task, payload) for key in keys}
    return {**payload, SIGNATURES_FIELD: signatures}


def signature_ok(task: str, payload: object, key: SigningKey) -> bool:
    """Whether ``payload`` (as received) carries a valid signature of task ``task`` under ``key``."""
    if not isinstance(payload, dict):
        return False
    signatures = payload.get(SIGNATURES_FIELD)
    signature = signatures.get(key.key_id) if isinstance(signatures, dict) else None
    if not isinstance(signature, str):
        return False
    try:
        expected = _signature(key, task, payload)
    except (TypeError, ValueError):  # not JSON after all (a NaN, a key that is not a string)
        return False
    return hmac.compare_digest(signature, expected)
