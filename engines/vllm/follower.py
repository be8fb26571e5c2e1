"""``out=vllm`` on a rank above 0 (``--node-rank R``): vLLM's headless workers, which serve nothing themselves.

A vLLM instance over several nodes has one engine core, on the leader (rank 0), which schedules every step and
broadcasts it; each other node runs only its share of the GPU workers, joined to the leader's
``torch.distributed`` group at ``master_addr:master_port``. That is what ``vllm serve --headless`` runs on those
nodes (``run_headless`` in vllm/entrypoints/cli/serve.py, vLLM 0.25 to 0.32): the engine config built with
``headless=True``, then a ``MultiprocExecutor`` that starts the node's workers and watches them.

``start()`` returns once the workers are up: they load their share of the model only when every rank has
joined the leader's group, so until the leader (and the other ranks) start it waits. ``wait()`` returns when a
worker has died; ``close()`` stops them.
"""

import logging
import os
from typing import Any

from engines.vllm.engine import visible_devices
from engines.vllm.settings import MISSING_PACKAGE, VllmSettings
from runtime.errors import ConfigError, ModelError

log = logging.getLogger(__name__)


class VllmFollower:
    """vLLM's workers of one rank above 0, for the leader at ``settings.nodes.leader``."""

    def __init__(self, settings: VllmSettings, *, base_gpu_id: int | None = None) -> None:
        if settings.nodes.is_leader:
            raise ConfigError("rank 0 is the leader: it runs vLLM's engine and serves, as a node of one does")
        self.settings = settings
        self.base_gpu_id = base_gpu_id
        self._executor: Any = None  # vllm.v1.executor.multiproc_executor.MultiprocExecutor

    def engine_config(self) -> Any:
        """vLLM's ``VllmConfig`` for this rank, headless (imports vLLM).

        Raises ModelError when vLLM refuses the settings, ConfigError when this rank would run whole
        data-parallel engines (which serve requests) rather than workers of the leader's.
        """
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.usage.usage_lib import UsageContext
        except ImportError as exc:
            raise ModelError(MISSING_PACKAGE) from exc
        try:
            # The leader builds its engine with this context (AsyncLLM.from_engine_args' default).
            config = AsyncEngineArgs(**self.settings.engine_kwargs()).create_engine_config(
                usage_context=UsageContext.ENGINE_CONTEXT, headless=True
            )
        except Exception as exc:  # vLLM raises ValueError, AssertionError, OSError... for a bad model or setting
            raise ModelError(f"vLLM could not configure {self.settings.model}: {exc}") from exc
        if config.parallel_config.node_rank_within_dp == 0:
            raise ConfigError(
                f"--node-rank {self.settings.nodes.node_rank} would run data-parallel engines of its own, which "
                "serve requests: run such a node as a worker of its own (without --num-nodes) instead"
            )
        return config

    def start(self) -> None:
        """Start this node's workers; returns once they have joined the leader and loaded their share.

        Raises ModelError when vLLM cannot start them.
        """
        if self.base_gpu_id is not None:
            current = os.environ.get("CUDA_VISIBLE_DEVICES")
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices(current, self.base_gpu_id, self.settings.local_gpus)
        config = self.engine_config()
        from vllm.v1.executor.multiproc_executor import MultiprocExecutor

        try:
            # Its own monitor thread would shut the workers down and call a failure callback that only an
            # engine core has: wait() watches them instead, as vLLM's run_headless does.
            self._executor = MultiprocExecutor(config, monitor_workers=False)
        except Exception as exc:  # a worker that failed to start, or died while it waited for the others
            raise ModelError(f"vLLM's workers of rank {self.settings.nodes.node_rank} did not start: {exc}") from exc

    def wait(self) -> str:
        """Block until one of the workers dies (or ``close()`` stops them); returns what happened."""
        executor = self._executor
        if executor is None:
            return "the workers were not started"
        executor.start_worker_monitor(inline=True)  # returns when a worker process has exited
        if getattr(executor, "is_failed", False):
            return "a vLLM worker process died (its error, if any, is logged above)"
        return "the workers were shut down"

    def close(self) -> None:
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown()
