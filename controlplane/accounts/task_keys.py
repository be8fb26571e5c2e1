"""The keys the control plane signs a node's tasks with: one per agent token (runtime/fleet_contract/signing.py).

Derived from the token's stored hash, the one thing the control plane keeps of it: whoever can read the
``ApiToken`` table can sign a node's tasks, as whoever can write the database can already tell the fleet
what to run. A node with two tokens (one being replaced) gets both signatures; a revoked (deleted) or
expired token's key signs nothing more, so its agent refuses every task from then on.
"""

from django.db.models.functions import Now

from controlplane.accounts.models import ApiToken
from runtime.fleet_contract.signing import SigningKey, signing_key


def node_task_keys(node: str) -> list[SigningKey]:
    """The signing keys of node ``node``'s agent tokens (none when it has no token: its tasks go unsigned,
    and its agent, which could not authenticate anyway, refuses them)."""
    tokens = ApiToken.objects.filter(kind=ApiToken.Kind.AGENT, node_name=node).exclude(expires_at__lte=Now())
    digests = tokens.values_list("key_hash", flat=True)
    return [signing_key(digest, node) for digest in digests]


def node_worker_key_sources(node: str) -> list[SigningKey]:
    """The signing keys of every agent token node ``node`` still has, expired ones included: what its workers'
    keys (runtime/fleet_contract/worker_keys.py) are derived from, to sign their fences and check their liveness.

    An expired token signs no more tasks, but the workers its agent started under it still run, and fencing
    them is most needed then: an agent whose token expired is refused, so its node falls silent. A revoked
    (deleted) token's workers hold keys nobody can derive any more (docs/architecture.md says what follows).
    """
    tokens = ApiToken.objects.filter(kind=ApiToken.Kind.AGENT, node_name=node)
    return [signing_key(digest, node) for digest in tokens.values_list("key_hash", flat=True)]
