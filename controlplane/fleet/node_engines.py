"""Which node runs which engine, as the nodes' agents report it (``Node.engines``): what the forms offer, each
engine labelled with its nodes, and what deploying a pipeline checks.

While no node is registered at all, every engine is offered and accepted: a fleet is set up before its agents
register (``flotilla up`` deploys its first pipeline as its agent starts), and such a pipeline waits pending
with a reason that says to start an agent. Once a node is registered, only the engines some node reports are.
"""

from controlplane.catalog.engines import install_hint
from controlplane.errors import Invalid
from controlplane.fleet.models import Node
from runtime.fleet_contract.engine_names import ENGINE_LABELS, FLEET_ENGINES

# A label names this many nodes, then counts the rest.
_NODES_NAMED = 3


def nodes_by_engine() -> dict[str, list[str]] | None:
    """Each engine some node runs, with those nodes' names in order; None when no node is registered."""
    rows = list(Node.objects.order_by("name").values_list("name", "engines"))
    if not rows:
        return None
    by_engine: dict[str, list[str]] = {}
    for name, engines in rows:
        for engine in engines:
            if engine in FLEET_ENGINES:
                by_engine.setdefault(engine, []).append(name)
    return by_engine


def engine_choices() -> list[tuple[str, str]]:
    """The engines a form offers, in the dashboard's order, each labelled with the nodes that run it
    ("llama.cpp (GGUF) — nodes a, b"); every engine while no node is registered (labelled "no node yet")."""
    by_engine = nodes_by_engine()
    if by_engine is None:
        return [(engine, f"{label} — no node yet") for engine, label in ENGINE_LABELS.items()]
    offered = [(engine, label) for engine, label in ENGINE_LABELS.items() if engine in by_engine]
    return [(engine, f"{label} — {_nodes(by_engine[engine])}") for engine, label in offered]


def check_engine_runs_somewhere(engine: str, where: str, field: str) -> None:
    """Raise Invalid (on ``field``, the message starting with ``where``) when nodes are registered and none
    runs ``engine``: its replicas would wait for good."""
    by_engine = nodes_by_engine()
    if by_engine is None or engine in by_engine:
        return
    offered = ", ".join(name for name in ENGINE_LABELS if name in by_engine) or "none"
    raise Invalid(
        f"{where}: no node runs {engine}; {install_hint(engine)}, or pick an engine a node runs ({offered})",
        field=field,
    )


def _nodes(names: list[str]) -> str:
    shown = ", ".join(names[:_NODES_NAMED])
    more = f" and {len(names) - _NODES_NAMED} more" if len(names) > _NODES_NAMED else ""
    return f"{'node' if len(names) == 1 else 'nodes'} {shown}{more}"
