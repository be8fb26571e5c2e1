"""Which machine a node is: the machine id its agent sends with every registration and heartbeat.

A node's name is its Celery queue, so two machines whose agents were given one name would share a queue
without either noticing, each taking half of the other's tasks. The first machine id a node sees is kept
on it (``Node.machine_id``; a node registered before agents sent one adopts the first it is sent), and a
registration or heartbeat for that name from another machine is refused (409) and audited: the operator
gives the second agent another name, or deletes the node when the machine was really replaced.

This is not authentication (the node's agent token is): a report that names no machine (an agent from
before machine ids) is not checked.
"""

from collections.abc import Iterator
from contextlib import contextmanager

from django.db import transaction

from controlplane.audit.records import Actor, record
from controlplane.errors import Conflict
from controlplane.fleet.models import Node

#: What an agent may send as its machine id: /etc/machine-id's 32 hex digits, or an id an operator chose.
MACHINE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"


class OtherMachine(Conflict):
    """A registration or heartbeat for a node that another machine registered."""

    def __init__(self, node: Node, machine_id: str) -> None:
        super().__init__(
            f"node {node.name} is registered by machine {node.machine_id}; this is machine {machine_id}: "
            "give this agent another --name, or delete the node first"
        )
        self.node = node
        self.machine_id = machine_id


def check_machine(node: Node, machine_id: str) -> None:
    """Raises OtherMachine when ``node`` belongs to a machine other than ``machine_id`` (either unsaid: no)."""
    if node.machine_id and machine_id and node.machine_id != machine_id:
        raise OtherMachine(node, machine_id)


def claimed_machine(node: Node, machine_id: str) -> str:
    """The machine id ``node`` has once a report from ``machine_id`` is taken (check_machine first)."""
    return node.machine_id or machine_id


@contextmanager
def audit_other_machine(actor: Actor) -> Iterator[None]:
    """Record, in a transaction of its own, an OtherMachine the block raises (the action's own transaction,
    which raised it, is rolled back with its audit entries), and let it go on."""
    try:
        yield
    except OtherMachine as exc:
        with transaction.atomic():
            record(
                actor,
                "node.machine_refused",
                exc.node,
                before={"machine_id": exc.node.machine_id},
                after={"machine_id": exc.machine_id, "refused": str(exc)},
            )
        raise
