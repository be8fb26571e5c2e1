"""Aborting a request in SGLang, by the id the worker gave it, until SGLang has let it go.

SGLang's ``TokenizerManager.abort_request(rid)`` sends an ``AbortReq`` to the scheduler only while the request is
in its ``rid_to_state`` (python/sglang/srt/managers/tokenizer_manager.py), and the scheduler aborts only what it
has in its queues: with pipeline parallelism or attention DP a request may reach its scheduler after the abort
did, which is then lost and the request runs to ``max_tokens``. So, as Dynamo's SGLang backend does
(components/src/dynamo/sglang/request_handlers/cancellation.py, ``_retry_abort``), the abort is sent again, with
backoff, for as long as SGLang still holds the request's state (it drops it when the request ends, aborted or
not). ``Aborts`` owns those retries; ``close()`` cancels what is left of them.
"""

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

#: How many times an abort is sent again while SGLang still holds the request, and the waits between them
#: (doubled each time, up to the last), as Dynamo's backend does.
RETRIES = 8
FIRST_WAIT_S = 0.05
LONGEST_WAIT_S = 1.0


class Aborts:
    """Aborts in one SGLang engine (``engine.tokenizer_manager``), each retried until SGLang lets it go."""

    def __init__(self, engine: Any, *, first_wait_s: float = FIRST_WAIT_S) -> None:
        self._manager = engine.tokenizer_manager
        self._first_wait_s = first_wait_s
        self._retries: set[asyncio.Task[None]] = set()

    def abort(self, rid: str) -> None:
        """Abort ``rid`` now, and again in the background while SGLang still holds it."""
        self._manager.abort_request(rid=rid, abort_all=False)
        registry = getattr(self._manager, "rid_to_state", None)
        if not isinstance(registry, Mapping) or rid not in registry:
            return  # ended already, or never sent: nothing runs
        task = asyncio.create_task(self._retry(rid, registry, registry[rid]), name=f"SGLang abort {rid}")
        self._retries.add(task)
        task.add_done_callback(self._retries.discard)

    async def _retry(self, rid: str, registry: Mapping[str, Any], state: Any) -> None:
        wait = self._first_wait_s
        for _ in range(RETRIES):
            await asyncio.sleep(wait)
            if registry.get(rid) is not state:
                return  # SGLang ended it
            self._manager.abort_request(rid=rid, abort_all=False)
            wait = min(wait * 2, LONGEST_WAIT_S)
        if registry.get(rid) is state:
            log.warning("SGLang still holds request %s after %d aborts: it may run to its max_tokens", rid, RETRIES)

    async def wait(self) -> None:
        """Return once every retry has ended (SGLang let each request go, or the retries ran out)."""
        await asyncio.gather(*self._retries, return_exceptions=True)

    async def close(self) -> None:
        for task in list(self._retries):
            task.cancel()
        await asyncio.gather(*self._retries, return_exceptions=True)
