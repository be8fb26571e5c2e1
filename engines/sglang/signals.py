"""Keeping the worker's SIGTERM drain when SGLang runs in its process.

SGLang's ``TokenizerManager.auto_create_handle_loop`` (python/sglang/srt/managers/tokenizer_manager.py), which its
``generate_request`` calls on the first request, adds its own handlers to the running loop when in the main thread:
SIGTERM (``SignalHandler.sigterm_handler``: a graceful exit that ends by killing the process tree) and SIGQUIT
(``running_phase_sigquit_handler``: a child failed, kill the tree). Added on the first request, its SIGTERM handler
would replace the worker's drain (deregister, let requests finish or migrate them), installed at start-up.

So the engine starts SGLang's loop itself at start-up, before the worker adds its handlers, and takes SGLang's
SIGTERM handler off again: the worker's, added after the engine has started (launcher/inputs/dyn.py), are the
ones that run, and SGLang's first request finds its loop started and adds none. SIGQUIT stays SGLang's: its
processes send it when one of them fails, and then the engine is gone and the process must end.
"""

import asyncio
import logging
import signal
import threading
from typing import Any

log = logging.getLogger(__name__)


def start_handle_loop(engine: Any, loop: asyncio.AbstractEventLoop) -> None:
    """Start SGLang's tokenizer-manager loop on ``loop`` now, and take SGLang's SIGTERM handler off it."""
    start = getattr(getattr(engine, "tokenizer_manager", None), "auto_create_handle_loop", None)
    if start is None:
        log.warning(
            "this SGLang has no TokenizerManager.auto_create_handle_loop: its SIGTERM handler may replace the drain"
        )
        return
    start()
    if threading.current_thread() is not threading.main_thread():
        return  # SGLang adds handlers only in the main thread (CPython takes signals there only)
    # The default until the worker adds its own; a process without one (in=text) just ends on SIGTERM.
    if loop.remove_signal_handler(signal.SIGTERM):
        log.debug("SGLang's SIGTERM handler taken off: the worker's drain handles SIGTERM")
