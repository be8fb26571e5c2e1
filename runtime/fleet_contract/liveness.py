"""Liveness claims: how a worker tells the control plane that it is alive, in a way no other worker can fake.

The reconciler does not evict an instance of a silent node whose worker is alive (controlplane/deployments/
reconciler.py): its agent is cut off, not its machine. A registration in etcd is no proof of that: any
worker can put keys there, under a lease it keeps alive, and etcd lets anyone refresh anyone's lease. So a
worker that holds a key (runtime/fleet_contract/worker_keys.py) proves it with a signed, dated claim under
its own lease, ``flotilla/liveness/<worker id in hex>``, signed anew every ``REFRESH_S``::

    {"instance": <control-plane instance id>, "worker": <worker id>, "at": <Unix time, whole seconds>,
     "signatures": {<key id>: <HMAC>}}

Only while it is asked: each put is an etcd revision, kept until etcd compacts its history (which it does
not by default; `flotilla up`'s etcd compacts hourly), so a claim every few seconds from every worker for
ever would fill an uncompacted etcd's quota in weeks.
The reconciler asks the workers of offline nodes only (``ask_for_claims``: ``flotilla/liveness-asked/<worker
id>``, under a lease it keeps alive while the node is offline, and deletes once it is back); each worker
watches its own request (``claim_while_asked``). Someone else's request only makes a worker write claims
for a while; a request deleted by someone else only stops them, which can hasten an eviction, not stop one.

The reconciler believes a worker alive only for a claim that verifies under the worker key of the instance
it is asked about (one per agent token of its node), names that instance and that worker, and is dated
within a window of its own clock (``check_claim``). A claim copied by another worker is therefore worth
the window at most: clocks of the nodes and the control plane must agree within it (NTP). A worker started
by hand has no key and claims nothing; the control plane has no instance of it to spare anyway.
"""

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import aetcd

from runtime.cluster.discovery import Discovery
from runtime.errors import DiscoveryUnavailable
from runtime.fleet_contract.signing import SigningKey, sign_payload, signature_ok
from runtime.fleet_contract.worker_keys import WorkerKey
from runtime.settings import parse_etcd_endpoint

log = logging.getLogger(__name__)

LIVENESS_PREFIX = "flotilla/liveness/"
ASKED_PREFIX = "flotilla/liveness-asked/"
#: How long a request outlives the last reconciler pass that wanted it.
ASKED_TTL_S = 60
#: How often a worker signs its claim again.
REFRESH_S = 10.0
#: How far a claim's date may be from the reader's clock (the reconciler's default): the refresh interval,
#: and room for clocks that do not quite agree.
WINDOW_S = 60.0
_RPC_TIMEOUT_S = 5.0
#: What a claim's signature is over, besides its body: no signature of another kind can pass for one.
_SIGNED_AS = "liveness v1"


def liveness_key(worker_id: int) -> str:
    """Where the worker whose etcd instance id is ``worker_id`` claims to be alive."""
    return f"{LIVENESS_PREFIX}{worker_id:x}"


def asked_key(worker_id: int) -> str:
    """Where the control plane asks the worker whose etcd instance id is ``worker_id`` to claim it is alive."""
    return f"{ASKED_PREFIX}{worker_id:x}"


def claim_value(key: WorkerKey, worker_id: int, at: float) -> bytes:
    """The claim of worker ``worker_id`` (holding ``key``) to be alive at Unix time ``at``."""
    body = {"instance": key.instance_id, "worker": worker_id, "at": int(at)}
    return json.dumps(sign_payload(_SIGNED_AS, body, [key.key]), sort_keys=True, separators=(",", ":")).encode()


class BadClaim(Exception):
    """A liveness claim that proves nothing; the message says why."""


def check_claim(
    value: bytes,
    *,
    instance_id: int,
    worker_id: int,
    keys: Sequence[SigningKey],
    now: float,
    window_s: float = WINDOW_S,
) -> None:
    """Return if ``value`` proves worker ``worker_id`` of instance ``instance_id`` alive at Unix time ``now``:
    signed under one of ``keys`` (the instance's worker keys, worker_keys.worker_keys), naming both, dated
    within ``window_s`` of ``now``. Raises BadClaim, and nothing else, for any other bytes."""
    try:
        claim = json.loads(value)
    except (ValueError, RecursionError) as exc:  # not JSON (or not UTF-8), or nested past the parser's depth
        raise BadClaim("not a signed claim (not JSON)") from exc
    if not isinstance(claim, dict):
        raise BadClaim("not a signed claim (not a JSON object)")
    if not keys:
        raise BadClaim("its node has no agent token, so no key to check it with")
    if not any(signature_ok(_SIGNED_AS, claim, key) for key in keys):
        raise BadClaim("its signature does not verify under the instance's worker key (unsigned, or another's)")
    if claim.get("instance") != instance_id or claim.get("worker") != worker_id:
        named = f"worker {_hex(claim.get('worker'))} of instance {claim.get('instance')!r}"
        raise BadClaim(f"it is signed for {named}, not this one (a genuine claim put back at another key)")
    at = claim.get("at")
    if not isinstance(at, int) or isinstance(at, bool):
        raise BadClaim("it carries no time")
    if abs(now - at) > window_s:
        when = f"{now - at:.0f} s old" if now >= at else f"dated {at - now:.0f} s ahead"
        raise BadClaim(
            f"it is {when}, outside the {window_s:g} s window (a stale copy kept by someone else, or clocks that "
            "disagree: check NTP on the node and the control plane)"
        )


def _hex(worker_id: object) -> str:
    """A worker id as every log shows one (hex), or what stands in its place."""
    return f"{worker_id:x}" if isinstance(worker_id, int) else repr(worker_id)


async def read_claims(endpoints: list[str]) -> dict[int, bytes]:
    """Every liveness claim in etcd now (worker id -> value), read through the first endpoint that answers.

    Raises ConfigError for a malformed endpoint, DiscoveryUnavailable when no endpoint answers.
    """
    claims: dict[int, bytes] = {}

    async def read(client: aetcd.Client) -> None:
        for worker_id, kv in (await _listing(client, LIVENESS_PREFIX)).items():
            claims[worker_id] = bytes(kv.value)

    await _through_first_answering(endpoints, read, "see which workers are alive")
    return claims


async def ask_for_claims(endpoints: list[str], worker_ids: Iterable[int]) -> None:
    """Ask the workers ``worker_ids`` (and no others) to claim that they are alive, through the first of
    ``endpoints`` that answers: a missing request is put under a lease of ``ASKED_TTL_S``, a present one has
    its lease refreshed (no new revision), one no longer wanted is deleted.

    Raises ConfigError for a malformed endpoint, DiscoveryUnavailable when no endpoint answers.
    """
    wanted = set(worker_ids)

    async def ask(client: aetcd.Client) -> None:
        present = await _listing(client, ASKED_PREFIX)
        for worker_id in present.keys() - wanted:
            await client.delete(asked_key(worker_id).encode())
        # A request with no lease is not ours (someone else put it): put ours over it, which lets it expire.
        leased = {worker_id: present[worker_id].lease for worker_id in wanted & present.keys()}
        missing = {worker_id for worker_id in wanted if not leased.get(worker_id)}
        for lease_id in set(leased.values()) - {0}:
            reply = await client.refresh_lease(lease_id)
            if reply is None or reply.TTL <= 0:  # expired meanwhile: its keys are gone, or about to be
                missing |= {worker_id for worker_id, lease in leased.items() if lease == lease_id}
        if missing:
            lease = await client.lease(ASKED_TTL_S)
            for worker_id in sorted(missing):
                await client.put(asked_key(worker_id).encode(), b"prove that you are alive", lease=lease.id)

    await _through_first_answering(endpoints, ask, "ask workers whether they are alive")


async def _listing(client: aetcd.Client, prefix: str) -> dict[int, Any]:
    """The keys under ``prefix`` that end in a worker id, by that id."""
    listed = {}
    for kv in (await client.get_prefix(prefix.encode())).kvs:
        try:
            listed[int(bytes(kv.key)[len(prefix) :].decode(), 16)] = kv
        except ValueError:  # not ours (no Flotilla process writes one): it names no worker
            continue
    return listed


async def _through_first_answering(
    endpoints: list[str], work: Callable[[aetcd.Client], Awaitable[None]], purpose: str
) -> None:
    failures = []
    for host, port in (parse_etcd_endpoint(endpoint) for endpoint in endpoints):
        client = aetcd.Client(host=host, port=port, timeout=_RPC_TIMEOUT_S)
        try:
            await work(client)
        except aetcd.ClientError as exc:
            failures.append(f"{host}:{port}: {str(exc).rpartition(': ')[2] or exc}")
            continue
        finally:
            await client.close()
        return
    raise DiscoveryUnavailable(f"cannot reach etcd to {purpose} ({'; '.join(failures)})")


async def claim_while_asked(discovery: Discovery, worker_id: int, key: WorkerKey) -> None:
    """Claim that worker ``worker_id`` is alive (``keep_claiming``) for as long as the control plane asks it
    to, until cancelled. Rides out etcd outages as ``Discovery.watch_prefix`` does."""
    own = asked_key(worker_id)
    claiming: asyncio.Task[None] | None = None
    try:
        async for event in discovery.watch_prefix(own):
            if event.key != own:  # the prefix of "…/abc" also matches "…/abcd"
                continue
            if event.kind == "put" and (claiming is None or claiming.done()):
                log.info("worker %x: its node is silent to the control plane; claiming that it is alive", worker_id)
                claiming = asyncio.create_task(keep_claiming(discovery, worker_id, key), name="liveness claims")
            elif event.kind == "delete" and claiming is not None:
                claiming.cancel()
                await asyncio.wait([claiming])
                claiming = None
    finally:
        if claiming is not None:
            claiming.cancel()
            await asyncio.wait([claiming])


async def keep_claiming(
    discovery: Discovery,
    worker_id: int,
    key: WorkerKey,
    *,
    interval_s: float = REFRESH_S,
    clock: Callable[[], float] = time.time,
) -> None:
    """Put worker ``worker_id``'s claim under its lease, signed anew every ``interval_s``, until cancelled.

    An etcd outage is ridden out (the lease's keepalive says so in the log); the claim is put again once
    etcd answers, and the lease's keys vanish with the process."""
    while True:
        try:
            await discovery.register(liveness_key(worker_id), claim_value(key, worker_id, clock()))
        except DiscoveryUnavailable as exc:
            log.debug("cannot renew the liveness claim of worker %x: %s", worker_id, exc)
        await asyncio.sleep(interval_s)
