"""Worker keys: how the agent hands one to a worker and what a worker makes of a fence with or without one
(runtime/fleet_contract/worker_keys.py, fences.py)."""

import pytest

from runtime.errors import ConfigError
from runtime.fleet_contract.fences import FenceTarget, ForgedFence, fence_reason, fence_value
from runtime.fleet_contract.signing import agent_signing_key
from runtime.fleet_contract.worker_keys import WORKER_KEY_VARIABLE, decode, encode, take_from_environment, worker_key

NODE_KEY = agent_signing_key("flt_node-a-token", "node-a")


def test_a_key_travels_through_the_environment_and_leaves_it_once_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    key = worker_key(NODE_KEY, 7)
    monkeypatch.setenv(WORKER_KEY_VARIABLE, encode(key))

    assert take_from_environment() == key
    assert take_from_environment() is None  # gone: no process started from here inherits it


@pytest.mark.parametrize("value", ["", "7", "7:abc", "x:" + "ab" * 32, "7:" + "AB" * 32, "-7:" + "ab" * 32])
def test_a_malformed_key_is_refused_without_repeating_it(value: str) -> None:
    with pytest.raises(ConfigError, match="FLOTILLA_WORKER_KEY is not '<instance id>:<64 hex digits>'") as refused:
        decode(value)
    assert value == "" or value not in str(refused.value)


def test_keys_differ_per_instance_and_per_node() -> None:
    other_node = agent_signing_key("flt_node-b-token", "node-b")
    assert len({worker_key(NODE_KEY, 7).key.secret, worker_key(NODE_KEY, 8).key.secret}) == 2
    assert worker_key(NODE_KEY, 7).key.secret != worker_key(other_node, 7).key.secret


def test_a_worker_without_a_key_reads_the_reason_of_any_fence_signed_or_not() -> None:
    signed = fence_value(FenceTarget(7, 0xA1), "node node-a stopped heartbeating", [NODE_KEY])
    assert fence_reason(signed, 0xA1, None) == "node node-a stopped heartbeating"
    assert fence_reason(b"go away", 0xA1, None) == "go away"
    assert fence_reason(b"", 0xA1, None) == "no reason given"


def test_a_worker_with_a_key_refuses_whatever_is_not_a_fence_signed_for_it() -> None:
    key = worker_key(NODE_KEY, 7)
    for value in (b"", b"\xff", b"[" * 100_000, b"[]", b'{"reason": "x"}', b"null"):
        with pytest.raises(ForgedFence):
            fence_reason(value, 0xA1, key)
    assert fence_reason(fence_value(FenceTarget(7, 0xA1), "", [NODE_KEY]), 0xA1, key) == "no reason given"
