"""The engines a pipeline's workers may run (the ``out=`` of ``flotilla run``), and what each needs.

The list is ``runtime/fleet_contract/engine_names.py``'s, which the agents accept: the catalog offers no engine an agent
would refuse, and an agent runs no engine the catalog does not offer. Of these, the forms offer the ones some
node's agent reports it runs, and deploying one no node runs is refused (``controlplane/fleet/node_engines.py``).
"""

from django.db import models

from runtime.fleet_contract.engine_names import DISAGG_ENGINES, ENGINE_LABELS, GGUF_ONLY_ENGINES, GPU_ONLY_ENGINES

# Members named as the values in capitals (Engine.MOCKER == "mocker"), labelled as the dashboard shows them.
Engine = models.TextChoices("Engine", [(name.upper(), (name, label)) for name, label in ENGINE_LABELS.items()])

#: Engines that load no weights (the mocker simulates an engine; echo returns the prompt): a model served by one
#: gets no memory estimate from its weights' size, which its replicas do not hold.
WEIGHTLESS_ENGINES = frozenset({"mocker", "echo_core", "echo_full"})

#: The engine that loads a multimodal projector (an ``mmproj`` GGUF file) beside a model's weights.
PROJECTOR_ENGINE = "llamacpp"

#: The engines every install of Flotilla runs (no optional package): an agent of this version reports them all.
ENGINES_IN_EVERY_INSTALL = frozenset({"mocker", "echo_core", "echo_full"})

__all__ = [
    "DISAGG_ENGINES",
    "GGUF_ONLY_ENGINES",
    "GPU_ONLY_ENGINES",
    "PROJECTOR_ENGINE",
    "WEIGHTLESS_ENGINES",
    "Engine",
    "install_hint",
]


def install_hint(engine: str) -> str:
    """What a person does to get ``engine`` onto a node, for the reasons that say no node runs it."""
    if engine in ENGINES_IN_EVERY_INSTALL:
        return f"run an agent of this version on a node (it runs {engine} with no extra install)"
    return f"install it with pip install 'flotilla[{engine}]' on a node"
