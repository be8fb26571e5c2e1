"""The garbage collector's share of a serving process's latency.

CPython's cyclic collector pauses the whole process while it walks the objects it tracks. In a
serving process most of those are long-lived: modules, the tokenizer, the web framework. A full
collection walking them stalls every stream in flight. Measured in the ingress under the trace
replay (bench/trace_replay.py), this was up to 124 ms, and ~0.7 s in 30 s over all generations.

``settle()``, called once a process has loaded what it keeps for its whole life, moves everything
alive into the permanent generation (``gc.freeze()``, as vLLM and SGLang do after start-up), so
later collections walk only what came after. Reference counting still frees almost everything a
request allocates; the collector is left to cycles.

It also raises the youngest generation's threshold. CPython collects it whenever the tracked
objects allocated since the last pass outnumber those freed by 700; in a server that count drifts up
and down with the requests in flight, so the passes come every few hundred milliseconds and each one
walks what the requests in flight hold. In the ingress and the workers that is their prompts, lists
of thousands of token ids: a young pass took 2-9 ms there (a ``gc.callbacks`` probe under the trace
replay, 49 passes of 2 ms or more in 30 s). At ``YOUNG_THRESHOLD`` the count is reached by real growth
(caches filling up), not by the ebb and flow of requests, so passes are rare; a request's objects are
mostly freed by reference counting before any pass sees them.
"""

import gc
import logging

log = logging.getLogger(__name__)

#: Net new tracked objects that start a collection of the youngest generation (CPython: 700).
YOUNG_THRESHOLD = 50_000


def settle() -> None:
    """Collect once, keep what is alive out of every later collection, and collect the young rarely."""
    gc.collect()
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, oldest)
    log.debug("gc: %d objects frozen after start-up; thresholds now %s", gc.get_freeze_count(), gc.get_threshold())
