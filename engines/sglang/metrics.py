"""SGLang's own Prometheus metrics (``sglang:*``), read for the worker's /metrics as SGLang's server serves them.

With ``enable_metrics`` SGLang keeps its metrics in prometheus_client's multiprocess mode: ``sglang.Engine``
points ``PROMETHEUS_MULTIPROC_DIR`` at a directory of its own before it starts its scheduler processes
(``set_prometheus_multiproc_dir``, python/sglang/srt/utils/common.py in 0.5.x), each of which writes its
metrics (token usage, cache hit rate, queue lengths) to files there; its HTTP server reads them with a
``MultiProcessCollector`` (``add_prometheus_middleware``, the same file). The tokenizer manager's metrics (time to
first token, end-to-end latency) live in this process: in files of their own when prometheus_client was first
imported after that variable was set, else in this process's default registry. ``SglangMetrics`` reads both,
each metric family once.
"""

import os
from collections.abc import Iterator

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

#: The prefix of SGLang's metric names.
PREFIX = "sglang:"


class SglangMetrics(Collector):
    """SGLang's metric families: those its processes wrote to ``directory``, then those of this process's default
    registry that they lack."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        # None: registered nowhere (prometheus_client leaves this class untyped)
        self._files = MultiProcessCollector(None, path=directory)  # type: ignore[no-untyped-call]

    def collect(self) -> Iterator[Metric]:
        seen: set[str] = set()
        for family in self._files.collect():  # type: ignore[no-untyped-call]
            seen.add(family.name)
            yield family
        for family in REGISTRY.collect():
            if family.name.startswith(PREFIX) and family.name not in seen:
                yield family


def sglang_registry(enabled: bool) -> CollectorRegistry | None:
    """The registry of SGLang's metrics in a started engine, or None when SGLang keeps none (``enable_metrics``
    off) or its directory is gone."""
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not enabled or not directory or not os.path.isdir(directory):
        return None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SglangMetrics(directory))
    return registry
