"""Start-up of the distributed inputs: waiting for etcd and NATS, which a supervisor's stop may cut short."""

import asyncio
import logging
import signal

from runtime.distributed import DistributedRuntime

log = logging.getLogger(__name__)


async def connect_runtime() -> DistributedRuntime | None:
    """``DistributedRuntime.connect()``, waiting for etcd and NATS for as long as it takes.

    Returns None if SIGTERM came first: the caller then cleans up and exits 0. SIGTERM's default action
    would kill the process where it waits, skipping the engine's clean-up. (Ctrl-C needs no help:
    asyncio.Runner turns SIGINT into a cancellation of the main task, which cancels the connection.)
    """
    loop = asyncio.get_running_loop()
    connecting = asyncio.create_task(DistributedRuntime.connect(), name="connect etcd and NATS")
    terminated = False

    def terminate() -> None:
        nonlocal terminated
        terminated = True
        connecting.cancel()

    loop.add_signal_handler(signal.SIGTERM, terminate)
    try:
        return await connecting
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if not terminated or (current is not None and current.cancelling()):
            raise  # our own cancellation, not the signal's
        log.warning("stopped by SIGTERM while waiting for etcd and NATS")
        return None
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
