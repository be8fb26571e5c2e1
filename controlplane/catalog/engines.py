"""The engines a pipeline's workers may run (the ``out=`` of ``flotilla run``), and what each needs.

The list is ``runtime/engine_names.py``'s, which the agents accept: the catalog offers no engine an agent
would refuse, and an agent runs no engine the catalog does not offer.
"""

from django.db import models

from runtime.engine_names import ENGINE_LABELS, GGUF_ONLY_ENGINES, GPU_ONLY_ENGINES

# Members named as the values in capitals (Engine.MOCKER == "mocker"), labelled as the dashboard shows them.
Engine = models.TextChoices("Engine", [(name.upper(), (name, label)) for name, label in ENGINE_LABELS.items()])

__all__ = ["GGUF_ONLY_ENGINES", "GPU_ONLY_ENGINES", "Engine"]
