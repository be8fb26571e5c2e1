"""Worker keys: one secret per instance, shared by the control plane and that instance's worker only.

Every worker can write to etcd, and a worker may run code nobody at the fleet wrote (a model's remote
code). So what the control plane tells one worker through etcd (a fence, runtime/fleet_contract/fences.py)
and what a worker tells the control plane (that it is alive, runtime/fleet_contract/liveness.py) are signed
with a key only those two hold: ``HMAC-SHA256(node's task-signing key, "…worker key v1\\n" + instance id)``.

Both sides derive it from what they already hold: the agent from its token (signing.agent_signing_key), the
control plane from the token's stored hash (controlplane/accounts/task_keys.py), so there is nothing new to
store or hand out. The agent gives each worker its own instance's key in ``FLOTILLA_WORKER_KEY`` (never a
task: agent/workers/spec.py), and the worker takes it out of its environment at once, so that the processes
it starts (an engine's) do not inherit it. A worker can therefore sign fences and liveness for itself only;
another worker's key would take its node's agent token (or its process's memory) to learn.

A worker started by hand (``flotilla run``, no agent) has no key.
"""

import hashlib
import hmac
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

from runtime.errors import ConfigError
from runtime.fleet_contract.signing import SigningKey

#: The variable the agent sets in a worker's environment: ``<instance id>:<secret in hex>``.
WORKER_KEY_VARIABLE = "FLOTILLA_WORKER_KEY"
_KEY_CONTEXT = b"flotilla worker key v1\n"
_KEY_ID_CONTEXT = b"flotilla worker key id v1\n"
_ENCODED = re.compile(r"([0-9]{1,19}):([0-9a-f]{64})")


@dataclass(frozen=True)
class WorkerKey:
    """The key of the worker of control-plane instance ``instance_id`` (its repr shows no secret)."""

    instance_id: int
    key: SigningKey


def _from_secret(instance_id: int, secret: bytes) -> WorkerKey:
    key_id = hashlib.sha256(_KEY_ID_CONTEXT + secret).hexdigest()[:16]
    return WorkerKey(instance_id, SigningKey(key_id, secret))


def worker_key(node_key: SigningKey, instance_id: int) -> WorkerKey:
    """The key of instance ``instance_id``'s worker on the node whose task-signing key is ``node_key``."""
    secret = hmac.new(node_key.secret, _KEY_CONTEXT + str(instance_id).encode(), hashlib.sha256).digest()
    return _from_secret(instance_id, secret)


def worker_keys(node_keys: Iterable[SigningKey], instance_id: int) -> list[SigningKey]:
    """The keys instance ``instance_id``'s worker may hold: one per agent token of its node (two while a
    token is being replaced), as the control plane signs and checks with them."""
    return [worker_key(node_key, instance_id).key for node_key in node_keys]


def encode(key: WorkerKey) -> str:
    """``key`` as the value of ``FLOTILLA_WORKER_KEY``."""
    return f"{key.instance_id}:{key.key.secret.hex()}"


def decode(value: str) -> WorkerKey:
    """The key in ``value`` (from ``encode``). Raises ConfigError saying what is wrong, never the value."""
    match = _ENCODED.fullmatch(value.strip())
    if match is None:
        raise ConfigError(
            f"{WORKER_KEY_VARIABLE} is not '<instance id>:<64 hex digits>': the agent sets it; "
            f"a worker started by hand needs none (unset it)"
        )
    return _from_secret(int(match[1]), bytes.fromhex(match[2]))


def take_from_environment() -> WorkerKey | None:
    """The key the agent gave this process, removed from its environment; None when it was given none.

    Raises ConfigError for a malformed value (removed all the same)."""
    value = os.environ.pop(WORKER_KEY_VARIABLE, None)
    return None if value is None else decode(value)
