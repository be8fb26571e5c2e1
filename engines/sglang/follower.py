"""``out=sglang`` on a rank above 0 (``--node-rank R``): SGLang's schedulers of this node, which serve nothing.

SGLang's ``Engine`` started with ``node_rank >= 1`` launches only this node's scheduler processes (its share of
the tensor-parallel ranks), which the leader's scheduler drives; it starts no tokenizer and takes no
requests. By default it would then block inside the constructor and serve a dummy health check on
``port``; with ``SGLANG_BLOCK_NONZERO_RANK_CHILDREN=0`` it returns once its schedulers are ready, as Dynamo's
SGLang worker starts it, and this process watches them instead.

``start()`` returns once the schedulers are ready (they wait for every rank to join at the leader's
``dist_init_addr``); ``wait()`` returns when one of them has exited; ``close()`` stops them, within a bounded
time whatever SGLang's own shutdown does.

With attention DP across nodes, this node's dp ranks each have a KV cache of their own: SGLang is started with
KV event publishers here (``kv_events_config``, as the leader's worker starts its own), and once the schedulers
are ready their events are relayed to the leader's worker over NATS (engines/sglang/dp_relay.py), on the subject of
the pipeline the leader serves (``in=dyn://...``, the same on every node) and ``NATS_SERVER``.
"""

import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
from pathlib import Path
from typing import Any

from engines.sglang.dp_relay import DpRelay
from engines.sglang.engine import KV_TOPIC, MISSING_PACKAGE, engine_kwargs, rank_endpoints, relayed_dp_ranks
from engines.shared.gpu_engine_args import GpuPlacement
from engines.shared.node_group import NodeGroup
from engines.shared.zmq_kv_events import free_tcp_ports
from runtime.cluster.addressing import EndpointAddress
from runtime.errors import ConfigError, ModelError

log = logging.getLogger(__name__)

#: How long ``close()`` lets SGLang's own shutdown take before it stops the schedulers itself.
SHUTDOWN_WAIT_S = 10.0


class SglangFollower:
    """SGLang's schedulers of one rank above 0, for the leader at ``nodes.leader``."""

    def __init__(
        self,
        model_path: Path,
        placement: GpuPlacement,
        engine_args: dict[str, Any],
        nodes: NodeGroup,
        *,
        relay_to: EndpointAddress | None = None,
        nats_servers: list[str] | None = None,
    ) -> None:
        """``relay_to``: the pipeline the leader serves, whose subject this node's dp ranks' KV events are relayed
        on over NATS (``nats_servers``), where they run here (attention DP across nodes)."""
        if nodes.is_leader:
            raise ConfigError("rank 0 is the leader: it runs SGLang's engine and serves, as a node of one does")
        assert nodes.leader is not None  # a rank above 0 has a leader (NodeGroup checks)
        ranks = relayed_dp_ranks(engine_args, nodes)
        self._relay: DpRelay | None = None
        endpoint = None
        if ranks and relay_to is None:
            log.warning(
                "dp ranks %d-%d run on this node, but the KV events of their caches are relayed to the leader only "
                "with in=dyn://... (the pipeline it serves): routers will not know their caches",
                ranks.start, ranks.stop - 1,
            )  # fmt: skip
        elif ranks and relay_to is not None:
            # Rank r publishes on base + r (its global rank), as on the leader's node.
            base = free_tcp_ports(ranks.stop)
            endpoint = f"tcp://*:{base}"
            self._relay = DpRelay(
                nats_servers or [], relay_to, nodes.leader, rank_endpoints(base, ranks), KV_TOPIC,
                name=f"sglang-relay-node-{nodes.node_rank}",
            )  # fmt: skip
        # Else no KV event publisher: the leader's schedulers publish the cache they manage.
        self.kwargs = engine_kwargs(model_path, placement, engine_args, kv_events_endpoint=endpoint, nodes=nodes)
        self.model_path = model_path
        self._engine: Any = None
        self._schedulers: list[multiprocessing.process.BaseProcess] = []

    def start(self) -> None:
        """Start this node's schedulers; returns once they are ready. Raises ModelError when SGLang cannot."""
        # Read when the Engine is built: return once the schedulers are ready instead of blocking in it.
        os.environ["SGLANG_BLOCK_NONZERO_RANK_CHILDREN"] = "0"
        try:
            import sglang
        except ImportError as exc:
            raise ModelError(MISSING_PACKAGE) from exc
        try:
            self._engine = sglang.Engine(**self.kwargs)
        except Exception as exc:  # SGLang raises what its model loader, CUDA or its arguments raise
            raise ModelError(
                f"SGLang could not start rank {self.kwargs['node_rank']} of {self.model_path}: {exc}"
            ) from exc
        # SGLang keeps no handle on them for a caller: they are this process's multiprocessing children.
        self._schedulers = multiprocessing.active_children()
        if not self._schedulers:
            raise ModelError("SGLang started no scheduler process on this node: nothing would run the model here")
        if self._relay is not None:
            # After the schedulers: their publishers are bound, and no process forks with the relay's thread.
            self._relay.start()

    def wait(self) -> str:
        """Block until one of the schedulers exits; returns which."""
        if not self._schedulers:
            return "the schedulers were not started"
        sentinels = {process.sentinel: process for process in self._schedulers}
        ended = sentinels[multiprocessing.connection.wait(list(sentinels))[0]]  # type: ignore[index]
        ended.join(timeout=1)
        return f"SGLang's process {ended.name} (pid {ended.pid}) exited with code {ended.exitcode}"

    def close(self) -> None:
        """Stop the schedulers: SGLang's shutdown first, then whatever of them it left running (SIGTERM, then
        SIGKILL 10 s later)."""
        if self._relay is not None:
            self._relay.close()
        engine, self._engine = self._engine, None
        shutdown = None
        if engine is not None:
            # Bounded: a shutdown that signals its processes and waits for them can wait for ever. A process
            # forked a moment before is one way: a signal that reaches it before CPython has set up the child
            # is dropped (the child clears the signals caught so far), and it runs on.
            shutdown = threading.Thread(target=engine.shutdown, name="SGLang shutdown", daemon=True)
            shutdown.start()
            shutdown.join(SHUTDOWN_WAIT_S)
            if shutdown.is_alive():
                log.warning(
                    "SGLang's shutdown has not ended after %.0f s; stopping its %d scheduler process(es) here",
                    SHUTDOWN_WAIT_S,
                    sum(process.is_alive() for process in self._schedulers),
                )
        for process in self._schedulers:
            if process.is_alive():
                process.terminate()
        for process in self._schedulers:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
        if shutdown is not None:
            shutdown.join(timeout=5)  # its processes are gone: let it finish what it does after them
