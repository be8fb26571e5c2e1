"""Fences: how the control plane retires worker instances whose node it has given up on.

When a node stops heartbeating, the control plane fails its instances and places them elsewhere. Its
workers may still run (the agent died, not the node), still registered in etcd and still served by
gateways beside their replacements. So the control plane puts a fence for each of those instances,
``flotilla/fences/<worker id in hex>`` (the worker's etcd instance id), and every worker watches its own
fence: when a genuine one appears, the worker logs the reason, deregisters and exits.

Every worker can write to etcd, so a fence is signed (runtime/fleet_contract/worker_keys.py): its value is
the JSON object ``{"instance": <control-plane instance id>, "worker": <worker id>, "reason": "…",
"signatures": {<key id>: <HMAC>}}``, signed under the fenced instance's worker key (one signature per agent
token of its node, as tasks are). A worker that holds a key obeys only a fence that verifies under it and
names its own instance and worker id; any other (unsigned, signed for another instance, or a genuine fence
of an earlier worker put back at this one's key) is logged, counted and ignored. A worker started by hand
has no key and obeys any fence, as before signing: the control plane never fences such a worker, since it
is none of its instances.

A fence lives under a lease of its own that nobody refreshes, so it vanishes after ``FENCE_TTL_S``;
worker ids are random 63-bit numbers, never reused, so a fence can only ever stop the one worker.
"""

import json
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import aetcd

from runtime.cluster.discovery import Discovery
from runtime.errors import DiscoveryUnavailable
from runtime.fleet_contract.signing import SigningKey, sign_payload, signature_ok
from runtime.fleet_contract.worker_keys import WorkerKey, worker_keys
from runtime.rate_limited_log import RateLimitedLog
from runtime.settings import parse_etcd_endpoint

log = logging.getLogger(__name__)

FENCES_PREFIX = "flotilla/fences/"
FENCE_TTL_S = 3600  # far longer than any worker keeps running without reaching etcd
_RPC_TIMEOUT_S = 5.0
#: What a fence's signature is over, besides its body: no signature of another kind can pass for one.
_SIGNED_AS = "fence v1"


def fence_key(worker_id: int) -> str:
    """The etcd key that, once put, stops the worker whose etcd instance id is ``worker_id``."""
    return f"{FENCES_PREFIX}{worker_id:x}"


@dataclass(frozen=True)
class FenceTarget:
    """One worker to fence: its control-plane instance id and its etcd instance id."""

    instance_id: int
    worker_id: int


def fence_value(target: FenceTarget, reason: str, node_keys: Iterable[SigningKey]) -> bytes:
    """The etcd value of ``target``'s fence, signed under its worker key for each of ``node_keys`` (its node's
    task-signing keys, controlplane/accounts/task_keys.py)."""
    body = {"instance": target.instance_id, "worker": target.worker_id, "reason": reason}
    signed = sign_payload(_SIGNED_AS, body, worker_keys(node_keys, target.instance_id))
    return json.dumps(signed, sort_keys=True, separators=(",", ":")).encode()


class ForgedFence(Exception):
    """A value at a worker's fence key that the worker must not obey; the message says why."""


def fence_reason(value: bytes, worker_id: int, key: WorkerKey | None) -> str:
    """Why the worker ``worker_id`` (holding ``key``, None for one started by hand) is fenced by ``value``.

    Raises ForgedFence when it holds a key and ``value`` is not a fence signed under it for this very worker.
    """
    try:
        fence = json.loads(value)
    except (ValueError, RecursionError):  # not JSON (or not UTF-8), or nested past the parser's depth
        fence = None
    if key is None:  # nobody can sign for a worker started by hand: it obeys whatever is put
        if isinstance(fence, dict) and isinstance(fence.get("reason"), str):
            return str(fence["reason"]) or "no reason given"
        return value.decode(errors="replace") or "no reason given"
    if not isinstance(fence, dict):
        raise ForgedFence("not a signed fence (not a JSON object)")
    if not signature_ok(_SIGNED_AS, fence, key.key):
        raise ForgedFence("its signature does not verify under this worker's key (unsigned, or signed for another)")
    if fence.get("instance") != key.instance_id or fence.get("worker") != worker_id:
        # Signed for this instance, so the control plane's: a fence of an earlier worker of it, put back.
        worker = fence.get("worker")
        named = f"{worker:x}" if isinstance(worker, int) else repr(worker)
        raise ForgedFence(f"it is signed for worker {named} of instance {fence.get('instance')!r}, not this one")
    reason = fence.get("reason")
    return reason if isinstance(reason, str) and reason else "no reason given"


async def put_fences(
    endpoints: list[str], targets: Iterable[FenceTarget], reason: str, node_keys: Sequence[SigningKey]
) -> None:
    """Fence ``targets`` (workers of one node, whose task-signing keys are ``node_keys``) with ``reason``,
    through the first of ``endpoints`` that answers.

    Raises ConfigError for a malformed endpoint, DiscoveryUnavailable when no endpoint answers.
    """
    fences = {fence_key(t.worker_id): fence_value(t, reason, node_keys) for t in set(targets)}
    if not fences:
        return
    failures = []
    for host, port in (parse_etcd_endpoint(endpoint) for endpoint in endpoints):
        client = aetcd.Client(host=host, port=port, timeout=_RPC_TIMEOUT_S)
        try:
            lease = await client.lease(FENCE_TTL_S)
            for key, value in sorted(fences.items()):
                await client.put(key.encode(), value, lease=lease.id)
        except aetcd.ClientError as exc:
            failures.append(f"{host}:{port}: {str(exc).rpartition(': ')[2] or exc}")
            continue
        finally:
            await client.close()
        log.info("fenced %d worker instance(s) in etcd at %s:%d: %s", len(fences), host, port, reason)
        return
    raise DiscoveryUnavailable(f"cannot reach etcd to fence workers ({'; '.join(failures)})")


async def watch_own_fence(
    discovery: Discovery,
    worker_id: int,
    key: WorkerKey | None,
    on_fenced: Callable[[str], None],
    refused: RateLimitedLog,
) -> None:
    """Call ``on_fenced(reason)`` once a fence of worker ``worker_id`` is put that it must obey (see
    ``fence_reason``), then return. One it must not is logged through ``refused`` (which counts them) and
    ignored: the watch goes on, so that a genuine fence put over a forged one still stops the worker.

    Rides out etcd outages as ``Discovery.watch_prefix`` does (a fence put meanwhile is seen in the
    listing that follows).
    """
    own = fence_key(worker_id)
    async for event in discovery.watch_prefix(own):
        # The prefix of "…/abc" also matches "…/abcd": only this worker's own key counts.
        if event.kind != "put" or event.key != own:
            continue
        try:
            reason = fence_reason(event.value or b"", worker_id, key)
        except ForgedFence as exc:
            refused.warning(
                f"ignored a fence of worker {worker_id:x} that is not the control plane's: {exc} "
                f"({refused.count} refused so far); someone else with write access to etcd put it"
            )
            continue
        on_fenced(reason)
        return
