"""The garbage collector's share of a serving process's latency.

CPython's cyclic collector pauses the whole process while it walks the objects it tracks. In a
serving process most of those are long-lived: modules, the tokenizer, the web framework. A full
collection walking them stalls every stream in flight. Measured in the ingress under the trace
replay (bench/trace_replay.py), this was up to 124 ms, and ~0.7 s in 30 s over all generations.

``settle()``, called once a process has loaded what it keeps for its whole life, moves everything
alive into the permanent generation (``gc.freeze()``, as vLLM and SGLang do after start-up), so
later collections walk only what came after. Reference counting still frees almost everything a
request allocates; the collector is left to cycles.
"""

import gc
import logging

log = logging.getLogger(__name__)


def settle() -> None:
    """Collect once, then keep what is alive out of every later collection."""
    gc.collect()
    gc.freeze()
    log.debug("gc: %d objects frozen after start-up", gc.get_freeze_count())
