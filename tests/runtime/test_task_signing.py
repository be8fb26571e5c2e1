"""Signed fleet tasks: a signature holds for the node's key over the payload as sent through JSON, and for
nothing else (another node's key, a changed field, another task's name)."""

import hashlib
import json

import msgspec

from runtime.fleet_contract.signing import agent_signing_key, sign_payload, signature_ok, signing_key, token_digest
from runtime.fleet_contract.tasks import (
    TASK_START_INSTANCE,
    TASK_STOP_INSTANCE,
    StartInstance,
    StopInstance,
    WorkerSpec,
)

TOKEN = "flt_agent-token-of-gpu-a"
KEY = agent_signing_key(TOKEN, "gpu-a")
START = StartInstance(
    spec=WorkerSpec(instance_id=3, pipeline="chat", group="aggregated", replica=0, engine="mocker"),
    node="gpu-a",
)


def signed_start() -> dict[str, object]:
    return sign_payload(TASK_START_INSTANCE, msgspec.to_builtins(START), [KEY])


def test_a_signed_task_holds_after_the_json_trip_and_decodes_with_its_signatures() -> None:
    sent = json.loads(json.dumps(signed_start(), indent=2))  # any JSON encoding, any key order
    assert signature_ok(TASK_START_INSTANCE, sent, KEY)
    assert msgspec.convert(sent, StartInstance).signatures == {KEY.key_id: sent["signatures"][KEY.key_id]}  # type: ignore[index]


def test_the_control_plane_derives_the_agents_key_from_the_stored_hash_alone() -> None:
    assert token_digest(TOKEN) == hashlib.sha256(TOKEN.encode()).hexdigest()  # controlplane's hash_token
    assert signing_key(token_digest(TOKEN), "gpu-a") == KEY


def test_a_signature_holds_for_no_other_key_field_or_task() -> None:
    payload = signed_start()
    assert not signature_ok(TASK_START_INSTANCE, payload, agent_signing_key(TOKEN, "gpu-b"))
    assert not signature_ok(TASK_START_INSTANCE, payload, agent_signing_key("flt_another-token", "gpu-a"))
    assert not signature_ok(TASK_STOP_INSTANCE, payload, KEY)
    changed = {**payload, "attempt": 1}
    assert not signature_ok(TASK_START_INSTANCE, changed, KEY)
    stop = sign_payload(TASK_STOP_INSTANCE, msgspec.to_builtins(StopInstance(instance_id=3, node="gpu-a")), [KEY])
    assert signature_ok(TASK_STOP_INSTANCE, stop, KEY)
    assert not signature_ok(TASK_STOP_INSTANCE, {**stop, "node": "gpu-b"}, KEY)


def test_an_unsigned_or_odd_payload_is_not_signed() -> None:
    unsigned = msgspec.to_builtins(START)
    for payload in (unsigned, {**unsigned, "signatures": "x"}, {**unsigned, "signatures": {KEY.key_id: 1}}, "x", None):
        assert not signature_ok(TASK_START_INSTANCE, payload, KEY)
    assert not signature_ok(TASK_START_INSTANCE, {**signed_start(), "x": float("nan")}, KEY)


def test_a_key_shows_its_id_never_its_secret() -> None:
    assert repr(KEY) == f"SigningKey(key_id={KEY.key_id!r})" and KEY.secret.hex() not in repr(KEY)
